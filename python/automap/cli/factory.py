"""The model factories the plan and estimate commands load: a Python file and
a function in it, named <python-file>:<factory>."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from automap.errors import AutomapError


def load_factory(target: str) -> Any:
    """The factory function named by ``<python-file>:<factory>``."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise AutomapError(f"expected <python-file>:<factory>, got {target!r}")
    file = Path(path)
    if not file.is_file():
        raise AutomapError(f"no such file: {file}")
    spec = importlib.util.spec_from_file_location(f"_automap_factory_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise AutomapError(f"{file} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent.resolve()))  # let the file import its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise AutomapError(f"{file} has no function {name!r}")
    return factory
