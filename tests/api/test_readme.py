"""The README's snippets work: every import and every ``automap.`` name they use
resolves, the snippets that need no process group run as written (in a
temporary folder, so nothing lands in the repository), and every ``automap``
subcommand the README shows exists."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import automap
from automap.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _python_blocks() -> list[str]:
    return _blocks("python")


def test_every_python_block_parses_and_imports():
    blocks = _python_blocks()
    assert len(blocks) >= 4
    for block in blocks:
        tree = ast.parse(block)
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in imports:
            exec(compile(ast.Module([node], []), "<README>", "exec"), {})


def test_every_automap_name_resolves():
    names = set()
    for block in _python_blocks():
        names |= set(re.findall(r"\bautomap((?:\.[A-Za-z_]\w*)+)", block))
    assert {".plan", ".autoparallelize", ".DeviceMesh", ".layout_path"} <= names
    for dotted in names:
        obj = automap
        for part in dotted.strip(".").split("."):
            obj = getattr(obj, part)  # AttributeError names what is missing


def test_all_names_are_exported():
    for name in automap.__all__:
        assert getattr(automap, name) is not None, name


@pytest.mark.parametrize("needle", ["automap.ShardingSpec.parse", "with torch.device(\"meta\")"])
def test_runnable_blocks_run(needle, tmp_path):
    """The planning walk-through (GPT-2 small on meta, 2x4, a budget) and the
    building blocks run as written, in a temporary working folder."""
    block = next(b for b in _python_blocks() if needle in b)
    script = tmp_path / "snippet.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_cli_commands_of_the_readme_exist():
    commands = set()
    for block in _blocks("bash"):
        commands |= set(re.findall(r"(?:^|&&)\s*automap (\w+)", block, flags=re.M))
    assert {"demo", "plan", "explain", "estimate", "detect"} <= commands
    for command in commands:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0, command


def test_readme_commands_write_outside_the_repository():
    """Files the README's commands and snippets write go to a temporary folder."""
    targets = []
    for block in _blocks("bash"):
        targets += re.findall(r"(?:-o|--output|--json)\s+(\S+)", block)
    for block in _python_blocks():
        targets += re.findall(r"to_json\(\s*([^)]+)\)", block)
    assert targets
    for target in targets:
        assert target.startswith(("$out/", '"/tmp/')), target
