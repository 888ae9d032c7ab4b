"""The public API is typed: every function and class in ``automap.__all__``
defined in Python annotates each parameter and its return (methods and
properties included), so ``mypy`` checks callers against it. ``.ci/run`` runs
``python3 -m mypy`` over the public modules (``[tool.mypy]`` in pyproject.toml);
the native classes are typed by ``automap/_core.pyi`` (checked by stubtest)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import automap

ROOT = Path(__file__).resolve().parents[2]


def _missing(fn, owner: str) -> list[str]:
    """The parameters of ``fn`` (and its return) without an annotation."""
    fn = inspect.unwrap(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a native callable: typed by the stub
        return []
    missing = [f"{owner}({p.name})" for i, p in enumerate(sig.parameters.values())
               if p.annotation is inspect.Parameter.empty
               and not (i == 0 and p.name in ("self", "cls"))]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append(f"{owner} -> ?")
    return missing


def _public_callables():
    for name in automap.__all__:
        obj = getattr(automap, name)
        module = getattr(obj, "__module__", "") or ""
        if not module.startswith("automap.") or module == "automap._core":
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, value in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if isinstance(value, property):
                    value = value.fget
                if inspect.isfunction(value):
                    yield f"{name}.{attr}", value


# Ids by name alone: a function's repr holds its address, which differs between
# xdist workers (they must collect the same ids).
@pytest.mark.parametrize("name, fn", [pytest.param(n, f, id=n) for n, f in _public_callables()])
def test_public_callables_are_fully_annotated(name, fn):
    assert _missing(fn, name) == []


def test_the_public_api_is_covered():
    names = {n for n, _ in _public_callables()}
    assert {"plan", "autoparallelize", "apply", "trace", "profile", "detect_cluster",
            "DeviceMesh.__init__", "Plan.explain", "Cluster.meshes"} <= names


def test_mypy_checks_the_modules_of_every_public_name():
    """``[tool.mypy] files`` lists the module of every public name."""
    config = (ROOT / "pyproject.toml").read_text()
    files = set(re.findall(r'"python/(automap/[\w/]+)\.py"', config))
    for name in automap.__all__:
        module = getattr(getattr(automap, name), "__module__", "automap")
        if module in ("automap._core", "builtins") or module is None:
            continue
        path = module.replace(".", "/")
        assert path in files or path + "/__init__" in files, (name, module)


def test_version():
    """``automap.__version__`` is the package's version (``automap --version``
    prints it: tests/cli/test_cli.py)."""
    config = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', config, flags=re.M).group(1)
    assert automap.__version__ == declared
