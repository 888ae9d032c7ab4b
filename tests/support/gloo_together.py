"""One pytest-xdist work unit for every multi-process test.

The suite runs on two xdist workers; two gloo process groups of 4 ranks at
once would put 8 processes on a 2-core machine. The controller schedules
without collecting, from node ids alone, so the multiprocess tests are read
from the test sources: a module-level ``pytestmark`` that names
``pytest.mark.multiprocess``, or that decorator on a test function (the two
forms this suite uses; ``check_collected`` refuses any other). xdist's own
``xdist_group`` marker cannot do this with pytest 9, whose node ids xdist's
worker can no longer suffix with the group."""

from __future__ import annotations

import ast
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

GROUP = "gloo"
MARK = "pytest.mark.multiprocess"


def multiprocess_tests(root: Path, tests: Path) -> tuple[set[str], set[str]]:
    """(test files, ``file::function`` ids) marked multiprocess under ``tests``,
    as node-id prefixes relative to ``root``."""
    files, functions = set(), set()
    for path in sorted(tests.rglob("test_*.py")):
        prefix = path.relative_to(root).as_posix()
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
                    and MARK in ast.unparse(node.value)):
                files.add(prefix)
            elif (isinstance(node, ast.FunctionDef)
                  and any(ast.unparse(d) == MARK for d in node.decorator_list)):
                functions.add(f"{prefix}::{node.name}")
    return files, functions


def is_multiprocess(nodeid: str, marked: tuple[set[str], set[str]]) -> bool:
    files, functions = marked
    path, _, name = nodeid.partition("::")
    return path in files or f"{path}::{name.split('[')[0]}" in functions


class GlooTestsTogether(LoadScopeScheduling):
    """xdist's scope scheduling with the multiprocess tests as one scope (the
    largest, so one worker starts on it while the other takes the rest) and
    every other test a scope of its own."""

    def __init__(self, config, log, marked: tuple[set[str], set[str]]) -> None:
        super().__init__(config, log)
        self.marked = marked

    def _split_scope(self, nodeid: str) -> str:
        return GROUP if is_multiprocess(nodeid, self.marked) else nodeid


def check_collected(items, marked: tuple[set[str], set[str]]) -> list[str]:
    """Node ids whose multiprocess marker the source scan disagrees with."""
    return [item.nodeid for item in items
            if (item.get_closest_marker("multiprocess") is not None)
            != is_multiprocess(item.nodeid, marked)]
