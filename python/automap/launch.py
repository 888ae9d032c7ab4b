"""Run a function on N local processes joined in a gloo process group on
127.0.0.1 (tests, the demo, benchmarks). Multi-node jobs use torchrun.

Ranks are forked from multiprocessing's fork server, which imports torch and
automap once: a rank then starts in a fraction of a second, where a spawned
one spends seconds importing torch (4 spawned ranks took 23 s on a busy
2-core machine, 4 forked 0.3 s). Each rank still starts from a process that
has run nothing but imports, and gets the caller's environment, working
folder and ``sys.path`` as a spawned one would."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

#: Modules the fork server imports before it forks any rank (missing ones are
#: skipped). Callers add what their rank functions import (``preload``).
_PRELOAD = ["torch", "torch.distributed", "automap", "automap.api"]


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too, so ranks need not (for
    example a model library every rank function imports). Takes effect when
    the server starts: at the first ``run_on_gloo`` of this process."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, timeout_s, fn, args, result_dir, environ):
    # The fork server's environment is the caller's when the server started;
    # a rank sees the caller's as it is now.
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    _thread_lock_for_progress_bars()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    status = 1
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
        status = 0
    except BaseException:
        with open(os.path.join(result_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalisation. destroy_process_group does not
    # join gloo's native threads (each group's two work loops, the transport
    # loops, the store's daemon on rank 0) while Python objects still hold the
    # groups (a module's process groups sit in reference cycles), and a work
    # loop releases each finished work a moment after waking the waiter. A
    # release whose tensors Python has already dropped takes the GIL; a native
    # thread that takes the GIL while the interpreter finalises is ended inside
    # a noexcept destructor, and C++ aborts: "terminate called without an
    # active exception", seen once on a busy machine. The results are on disk:
    # nothing is left to finalise.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _thread_lock_for_progress_bars() -> None:
    """torch.fx's Interpreter opens a (disabled) tqdm bar per run, and tqdm's
    first bar makes a multiprocessing lock: a named semaphore that a rank,
    leaving by ``os._exit``, never unlinks ("There appear to be 1 leaked
    semaphore objects" when the launcher exits). A rank draws no bars from
    several processes: a thread lock serves."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def run_on_gloo(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes
    in one gloo group; return their results by rank, or raise the first
    error with the failing rank's traceback. ``fn`` must be importable
    (module level) and its results picklable by torch.save."""
    import torch

    module = getattr(fn, "__module__", None)
    extra = [module] if module and module != "__main__" else []
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD + extra)
    with tempfile.TemporaryDirectory() as result_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, free_port(), timeout_s, fn, args, result_dir, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        # A margin for a rank to report its own collective timeout first.
        deadline = time.monotonic() + timeout_s + 10.0
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} gloo processes did not finish in "
                                       f"{timeout_s:.0f} s")
        except ProcessException as e:
            # The first rank to fail is the cause; the others' errors (a peer
            # that closed its connection) follow from it.
            errors = sorted((os.path.join(result_dir, f) for f in os.listdir(result_dir)
                             if f.endswith(".err")), key=os.path.getmtime)
            detail = open(errors[0]).read() if errors else str(e)
            raise RuntimeError(f"rank process failed:\n{detail}") from None
        finally:
            # On any way out (an error, a timeout, a test's own timeout or ^C) no
            # rank outlives the call: SIGKILL also ends a stopped one.
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5.0)
        return [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False)
                for r in range(world_size)]
