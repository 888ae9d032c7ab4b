"""The device profile: how fast one device multiplies, moves memory and starts
a kernel. The step-time model prices a node's local work with it as a
roofline plus a fixed cost per kernel::

    max(flops / flops_per_s, bytes / memory_bandwidth_bytes_per_s) + kernels * op_overhead_s

Measured in well under a second (repeats, medians): a matmul in the
parameters' dtype (512^3 on CPUs, 4096^3 on GPUs), an elementwise add into
a new tensor (as training allocates its activations), and a chain of
tiny multiplications run forward and backward under autograd (the time per
kernel of dispatch, autograd bookkeeping and launch). Processes that share
the machine in training must measure at the same time (``measure_concurrently``,
``automap detect``): four ranks on two cores each get half a core.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from automap.errors import InvalidCostModelError

#: What a cluster file that names CUDA devices but not their speeds is priced
#: with when this process has no GPU to measure: an A100-class device.
GPU_FALLBACK = {"flops_per_s": 100e12, "memory_bandwidth_bytes_per_s": 1.5e12,
                "op_overhead_s": 5e-6}

FIELDS = ("flops_per_s", "memory_bandwidth_bytes_per_s", "op_overhead_s")


def check_positive(name: str, value: Any) -> float:
    """``value`` as a float; an ``InvalidCostModelError`` naming ``name``
    unless it is a finite number > 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (math.isfinite(number) and number > 0):
        raise InvalidCostModelError(f"{name} must be a finite number > 0, got {value!r}")
    return number


@dataclass(frozen=True)
class DeviceProfile:
    """Sustained FLOP/s, memory bandwidth (bytes/s) and the fixed time of one
    kernel (seconds) of one device, as each rank sees them while every rank
    computes. ``shared_slowdown``: how many times faster a rank computes alone
    than while every rank does (its matmul rate alone over the concurrent
    one; >= 1): ranks sharing cores or a device (four gloo ranks on two
    cores), 1 where each rank has a device of its own. A pipeline's stages
    idle in its bubbles, and the ranks that still compute then get the
    share the idle ones leave (``planner/pipeline_partition.schedule_step_s``)."""

    flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    op_overhead_s: float
    shared_slowdown: float = 1.0

    def __post_init__(self) -> None:
        for name in FIELDS:
            object.__setattr__(self, name, check_positive(name, getattr(self, name)))
        object.__setattr__(self, "shared_slowdown",
                           max(1.0, check_positive("shared_slowdown", self.shared_slowdown)))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def work_s(self, flops: float, bytes_moved: float, kernels: float) -> float:
        """Roofline time of ``flops`` and ``bytes_moved`` plus ``kernels`` overheads."""
        return (max(flops / self.flops_per_s, bytes_moved / self.memory_bandwidth_bytes_per_s)
                + kernels * self.op_overhead_s)


def slowest(profiles: Sequence[DeviceProfile]) -> DeviceProfile:
    """The profile of the slowest device in every respect (it paces a
    synchronous step)."""
    return DeviceProfile(min(p.flops_per_s for p in profiles),
                         min(p.memory_bandwidth_bytes_per_s for p in profiles),
                         max(p.op_overhead_s for p in profiles),
                         max(p.shared_slowdown for p in profiles))


def _median_s(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 2,
              sample_s: float = 0.02) -> float:
    """Median seconds of one call of ``fn`` after ``warmup`` calls, each of
    ``repeats`` samples timing enough calls to last ``sample_s``: longer than
    a scheduler's time slice, so processes sharing a core each see their
    share (a single short call runs at full speed or not at all)."""

    def timed(calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed(warmup)  # library initialisation, allocator growth: not steady state
    calls = max(1, math.ceil(sample_s / max(timed(1), 1e-9)))
    return statistics.median(timed(calls) / calls for _ in range(repeats))


def measure_device_profile(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                           repeats: int = 5) -> DeviceProfile:
    """Measure this process's ``device`` now (no cache): see the module docstring."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    n = 4096 if gpu else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    flops_per_s = 2.0 * n**3 / _median_s(lambda: a @ b, repeats, device)

    # Operands the size of a small model's activations (4 MiB; 256 MiB on GPUs),
    # the result freshly allocated as in training.
    numel = (64 if gpu else 1) * 2**20
    x = torch.ones(numel, device=device)
    y = torch.ones(numel, device=device)
    bandwidth = 3.0 * numel * 4 / _median_s(lambda: x + y, repeats, device)

    chain = 32
    leaf = torch.ones(1, device=device, requires_grad=True)

    def tiny_forward_backward() -> None:
        out = leaf
        for _ in range(chain):
            out = out * 1.0001
        out.backward()

    # 2 * chain kernels: each multiplication and its backward.
    overhead_s = _median_s(tiny_forward_backward, repeats, device) / (2 * chain)
    return DeviceProfile(flops_per_s, bandwidth, overhead_s)


_measured: dict[tuple, DeviceProfile] = {}


def local_device_profile(device: str | torch.device | None = None,
                         dtype: torch.dtype = torch.float32) -> DeviceProfile:
    """This process's device (default: the current GPU, else the CPU),
    measured at first use and cached per device, dtype and thread count."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    key = (str(device), dtype, torch.get_num_threads())
    if key not in _measured:
        _measured[key] = measure_device_profile(device, dtype)
    return _measured[key]


def measure_concurrently(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                         group: Any = None, cached: bool = False) -> DeviceProfile:
    """Every rank of the process ``group`` (collective) measures its device at
    the same time, as they compute in training; every rank gets the slowest,
    with ``shared_slowdown`` from the group's first rank measured alone just
    before (its matmul rate over the slowest concurrent one; 1 below
    ``SHARED_MIN_SLOWDOWN``). ``cached``: reuse this group's first
    measurement (every rank must ask alike)."""
    import torch.distributed as dist

    device = torch.device(device)
    key = (str(device), dtype, torch.get_num_threads(),
           tuple(dist.get_process_group_ranks(group or dist.group.WORLD)))
    if cached and key in _concurrent:
        return _concurrent[key]
    device_ids = [device.index] if device.type == "cuda" else None
    # The group's first rank alone (the others wait), then every rank at once.
    dist.barrier(group=group, device_ids=device_ids)
    first = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
    alone = measure_device_profile(device, dtype) if dist.get_rank() == first else None
    dist.barrier(group=group, device_ids=device_ids)
    mine = measure_device_profile(device, dtype)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (mine.to_dict(), alone and alone.flops_per_s),
                           group=group)
    found = slowest([DeviceProfile(**p) for p, _ in everyone])
    solo = max(f for _, f in everyone if f is not None) / found.flops_per_s
    _concurrent[key] = dataclasses.replace(
        found, shared_slowdown=solo if solo >= SHARED_MIN_SLOWDOWN else 1.0)
    return _concurrent[key]


_concurrent: dict[tuple, DeviceProfile] = {}

#: A rank alone faster than this many times its concurrent rate shares its
#: compute; below, the difference is taken for noise between two measurements
#: (ranks with a device each measure about 1).
SHARED_MIN_SLOWDOWN = 1.2


def resolve_device_profile(*, flops_per_s: float | None = None,
                           memory_bandwidth_bytes_per_s: float | None = None,
                           op_overhead_s: float | None = None,
                           shared_slowdown: float | None = None, known: dict | None = None,
                           kind: str | None = None, dtype: torch.dtype = torch.float32
                           ) -> DeviceProfile:
    """The profile to plan with, field by field: the explicit argument, else
    ``known`` (a cluster's measured fields, None where unknown), else this
    process's device measured at first use (``shared_slowdown``: the
    argument, else ``known``'s, else 1). ``kind`` is the planned devices'
    type: CUDA devices planned from a process without a GPU take
    ``GPU_FALLBACK`` (never a CPU's figures for a GPU, nor the reverse)."""
    given = {"flops_per_s": flops_per_s,
             "memory_bandwidth_bytes_per_s": memory_bandwidth_bytes_per_s,
             "op_overhead_s": op_overhead_s}
    values = {name: check_positive(name, v) for name, v in given.items() if v is not None}
    for name in FIELDS:
        if name not in values and known and known.get(name) is not None:
            values[name] = check_positive(name, known[name])
    shared = shared_slowdown or (known or {}).get("shared_slowdown") or 1.0
    if len(values) < len(FIELDS):
        if kind == "cuda" and not torch.cuda.is_available():
            fill = GPU_FALLBACK
        else:
            fill = local_device_profile("cpu" if kind == "cpu" else None, dtype).to_dict()
        values = {**fill, **values}
    return DeviceProfile(**{**values, "shared_slowdown": shared})
