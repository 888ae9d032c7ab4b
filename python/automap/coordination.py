"""How the ranks agree during setup (planning, validation, generation), so that a
failure on one rank reaches every rank as the same typed error and a rank that
stopped is reported instead of waited for.

``SetupChannel`` is a gloo group over the world (also beside an NCCL default
group: setup messages are small CPU objects) whose collectives time out after
``timeout_s``. ``each_rank(step, fn)`` runs ``fn`` on every rank and exchanges
the outcomes: if any rank failed, every rank raises the failing rank's error
(same class, message and attributes, with a note naming the rank).
``from_leader(step, leader, fn)`` runs ``fn`` on one rank and hands its result,
or its error, to all. ``check_in(step)`` is a monitored barrier: a rank that
does not arrive within the timeout is named in a ``DistributedError`` on the
others. Gloo collectives that time out become ``DistributedError`` too."""

from __future__ import annotations

import math
import numbers
import pickle
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from automap.errors import AutomapError, DistributedError, InvalidArgumentError

#: Seconds a rank waits for the others at each setup step, planning on the
#: leader included. Raise it for models whose planning takes longer.
DEFAULT_SETUP_TIMEOUT_S = 300.0


def check_timeout(value) -> float:
    """A setup timeout: a finite number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"setup_timeout_s must be a finite number of seconds > 0, "
                                   f"got {value!r}")
    return float(value)


class SetupChannel:
    """A gloo group over the world for setup messages, whose collectives time
    out after ``timeout_s``. Creating it is collective (every rank, same
    order); ``of_world`` keeps one for the life of the default process group,
    which destroys it (destroying it here could cut a peer's last message short),
    and sets the timeout of each setup."""

    _current: SetupChannel | None = None

    def __init__(self, timeout_s: float = DEFAULT_SETUP_TIMEOUT_S) -> None:
        self.timeout_s = check_timeout(timeout_s)
        self.rank = dist.get_rank()
        self.world = dist.group.WORLD
        self.group = self._guard("creating the setup group", lambda: dist.new_group(
            backend="gloo", timeout=timedelta(seconds=self.timeout_s)))

    @classmethod
    def of_world(cls, timeout_s: float = DEFAULT_SETUP_TIMEOUT_S) -> SetupChannel:
        """The channel of the current default group (made on first use), its
        collectives bounded by ``timeout_s`` from now on."""
        timeout_s = check_timeout(timeout_s)
        channel = cls._current
        if channel is None or channel.world is not dist.group.WORLD:
            channel = cls._current = cls(timeout_s)
        channel.set_timeout(timeout_s)
        return channel

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = check_timeout(timeout_s)
        timeout = timedelta(seconds=self.timeout_s)
        if hasattr(dist, "set_timeout"):
            dist.set_timeout(timeout, self.group)
        else:  # torch < 2.8
            dist.distributed_c10d._set_pg_timeout(timeout, self.group)

    def _guard(self, step: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as exc:  # gloo timeouts and lost peers (DistBackendError)
            raise self._lost(step, exc) from None

    def _lost(self, step: str, exc: RuntimeError) -> DistributedError:
        """The error of a setup step some rank did not answer in time."""
        text = str(exc).strip()
        late = re.search(r"Ranks? ([0-9][0-9, ]*) failed to pass monitoredBarrier", text)
        if late is not None:  # the monitored barrier names the ranks
            ranks = re.findall(r"[0-9]+", late.group(1))
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(ranks)}"
            return DistributedError(
                f"{step}: {who} did not arrive within {self.timeout_s:g} s (setup_timeout_s): "
                f"stopped, crashed, or slower than that")
        first = text.splitlines()[0] if text else type(exc).__name__
        return DistributedError(
            f"{step}: the other ranks did not all answer within {self.timeout_s:g} s "
            f"(setup_timeout_s); a rank stopped, crashed or is slower than that ({first})")

    def check_in(self, step: str) -> None:
        """Wait until every rank reaches ``step``; name those that do not in time."""
        self._guard(step, lambda: dist.monitored_barrier(
            self.group, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True))

    def each_rank(self, step: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on every rank; its result here. If any rank failed, a failing
        rank raises its own error and the others the first failing rank's."""
        error, shared, result = _run(fn)
        outcomes: list = [None] * dist.get_world_size()
        self._guard(step, lambda: dist.all_gather_object(outcomes, shared, group=self.group))
        if error is not None:
            raise error
        for rank, other in enumerate(outcomes):
            if other is not None:
                _raise_copy(other, rank, self.rank, step)
        return result

    def from_leader(self, step: str, leader: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` on ``leader``; its result (picklable) on every rank, or its
        error on every rank."""
        payload: list = [None]
        error = None
        if self.rank == leader:
            error, shared, result = _run(fn)
            payload = [("error", shared) if error is not None else ("ok", result)]
        self._guard(step, lambda: dist.broadcast_object_list(payload, src=leader,
                                                             group=self.group))
        if error is not None:
            raise error
        kind, value = payload[0]
        if kind == "error":
            _raise_copy(value, leader, self.rank, step)
        return value


def _run(fn: Callable[[], Any]) -> tuple[Exception | None, bytes | None, Any]:
    """(None, None, result), or (the error, its pickled form to share, None)."""
    try:
        return None, None, fn()
    except Exception as exc:
        try:
            shared = pickle.dumps(exc)
            pickle.loads(shared)
        except Exception:  # an error that does not survive pickling is sent as text
            shared = pickle.dumps(DistributedError(f"{type(exc).__name__}: {exc}"))
        return exc, shared, None


def _raise_copy(shared: bytes, rank: int, here: int, step: str):
    try:
        exc = pickle.loads(shared)
    except Exception as unreadable:  # a class this rank cannot import
        exc = unreadable
    if not isinstance(exc, AutomapError):
        exc = DistributedError(f"rank {rank} failed while {step}: {type(exc).__name__}: {exc}")
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on rank {rank} while {step}; this is rank {here})")
    raise exc
