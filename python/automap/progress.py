"""Progress of long work (tracing, profiling, ILP solves, checkpoint search,
cluster measurements, the demo's steps) and where it is shown.

The library only logs: every module logs through a child of the ``automap``
logger (``logging.getLogger(__name__)``), so an application decides what it
sees with the logging levels it sets, and nothing is printed on stdout. A
stage of work (``stage``) logs one INFO line when it ends, with its time;
its inner steps (``Stage.advance``) log at DEBUG.

``console()`` shows them on stderr (the command line runs every subcommand
inside one unless ``-q``; ``automap.plan(..., verbose=True)`` opens one): on a
terminal each running stage is a tqdm bar and finished stages are lines
above it; otherwise one line per stage. No torch here: the CLI imports it
before any subcommand runs."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, ParamSpec, TextIO, TypeVar

#: The package logger; modules log through its children (``automap.<module>``).
LOGGER_NAME = "automap"
logger = logging.getLogger(LOGGER_NAME)

P = ParamSpec("P")
R = TypeVar("R")


class _StderrHandler(logging.Handler):
    """Writes records on the current ``sys.stderr`` (looked up per record, so
    that a redirected or captured stderr gets them), through tqdm on a
    terminal so that lines do not tear a running bar."""

    def __init__(self, tty: bool) -> None:
        super().__init__(logging.INFO)
        self.tty = tty
        self.setFormatter(logging.Formatter("automap: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if self.tty:
                from tqdm import tqdm

                tqdm.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)
        except Exception:  # logging must never end the work it reports on
            self.handleError(record)


class _Console:
    """The installed stderr display: its handler and whether bars are drawn."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.handler = _StderrHandler(tty)


#: The console a ``console()`` block installed (None: progress is logged only).
_console: _Console | None = None
#: Inside a ``console()`` block, shown or quiet: inner blocks change nothing.
_open = False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False


@contextlib.contextmanager
def console(enabled: bool = True) -> Iterator[None]:
    """Show automap's progress on stderr inside the block: the ``automap``
    logger at INFO with a stderr handler (bars on a terminal, one line per
    stage otherwise). ``enabled=False`` (the CLI's ``-q``): the logger at
    WARNING, nothing shown but warnings. Nested blocks keep the outer one."""
    global _console, _open
    if _open:
        yield
        return
    level = logger.level
    shown = _Console(_is_terminal(sys.stderr)) if enabled else None
    if shown is None:
        logger.setLevel(logging.WARNING)
    else:
        logger.addHandler(shown.handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    _console, _open = shown, True
    try:
        yield
    finally:
        _console, _open = None, False
        if shown is not None:
            logger.removeHandler(shown.handler)
        logger.setLevel(level)


def verbose(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """The library's ``verbose=`` switch: ``console()`` when set, else nothing
    (whatever logging the application configured stays as it is)."""
    return console() if enabled else contextlib.nullcontext()


class Stage:
    """A stage of work that reports when it ends: one INFO line on ``log``
    (``"<label>: <result> (<seconds> s)"``); on a console on a terminal, a
    tqdm bar while it runs (``total``: the steps it counts, None: unknown).
    ``enabled=False`` (e.g. ranks other than 0) reports nothing; a stage
    that ends within ``min_s`` seconds logs its line at DEBUG (a step that is
    usually quick need not fill the console)."""

    def __init__(self, log: logging.Logger, label: str, total: int | None = None,
                 enabled: bool = True, min_s: float = 0.0) -> None:
        self.log, self.label, self.total, self.enabled = log, label, total, enabled
        self.min_s = min_s
        self.done = 0
        self.outcome = ""
        self.start_s = time.perf_counter()
        self._bar: Any = None

    def __enter__(self) -> Stage:
        self.start_s = time.perf_counter()
        shown = _console
        if self.enabled and shown is not None and shown.tty and self.log.isEnabledFor(logging.INFO):
            from tqdm import tqdm

            # Without a total there is nothing to count: the label and the time.
            bar_format = None if self.total is not None else "{desc} [{elapsed}]"
            self._bar = tqdm(total=self.total, desc=f"automap: {self.label}", file=sys.stderr,
                             leave=False, dynamic_ncols=True, bar_format=bar_format)
        return self

    def advance(self, detail: str = "", steps: int = 1) -> None:
        """``steps`` more steps done (``detail``: what the last one was)."""
        self.done += steps
        if not self.enabled:
            return
        if self._bar is not None:
            if detail:
                self._bar.set_postfix_str(detail, refresh=False)
            self._bar.update(steps)
        total = f"/{self.total}" if self.total is not None else ""
        self.log.debug("%s: %s [%d%s]", self.label, detail, self.done, total)

    def result(self, outcome: str) -> None:
        """What the stage's line says it found (e.g. ``"412 nodes"``)."""
        self.outcome = outcome

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_s

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self.enabled:
            return
        if kind is not None:
            self.log.debug("%s: stopped by %s after %.1f s", self.label, kind.__name__,
                           self.elapsed_s)
            return
        outcome = f": {self.outcome}" if self.outcome else ""
        elapsed_s = self.elapsed_s
        level = logging.INFO if elapsed_s >= self.min_s else logging.DEBUG
        self.log.log(level, "%s%s (%.1f s)", self.label, outcome, elapsed_s)


def stage(log: logging.Logger, label: str, total: int | None = None,
          enabled: bool = True, min_s: float = 0.0) -> Stage:
    """``with stage(log, "traced the model") as s: ...; s.result("412 nodes")``."""
    return Stage(log, label, total, enabled, min_s)


def verbose_switch(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorates a library call whose keyword ``verbose=True`` shows its
    progress on stderr (``console()``) for the call; without it, progress is
    only logged."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with verbose(bool(kwargs.get("verbose", False))):
            return fn(*args, **kwargs)

    return call
