"""The cluster detector (MAP, section 4.2): measure the latency and bandwidth
of every pair of ranks and of candidate groups with torch.distributed, fit
the alpha-beta link model, and return a ``Cluster``.

Every rank calls ``detect_cluster`` (it is collective) and gets the same
``Cluster``. The schedule is fixed up front, so its time is bounded:

1. **Pairs**: a round-robin tournament (circle method). In each of the N-1
   rounds (N for odd N, one rank sitting out) every rank exchanges buffers
   with one partner, all pairs at once, by send/recv: N(N-1)/2 pairs in O(N)
   rounds, with no process group per pair (a pair group each would cost
   O(N^2) communicator set-ups). A bidirectional exchange of S bytes moves
   what a 2-rank all-reduce of S bytes does, so its bus bandwidth is S / t.
   The tournament runs ``repeats`` times; each pair's link is the median of
   its repeats, and their spread sets how far apart two bandwidths must be
   to split a tier (``topology.significant_rel_tol``): repeated runs on one
   machine find the same tiers.
2. **Contention**: 1, 2, 4, ... pairs of the first round exchange the
   largest size at once, three times over (interleaved, so a burst of
   outside load does not hit one step only), showing how pair bandwidth
   drops when links share a bottleneck.
3. **Groups**: every axis of the best few candidate meshes (built from the
   pair matrix) runs an all-reduce on all its groups concurrently, as
   training does; bus bandwidth from the paper's busbw = algbw * 2(n-1)/n.
   These measurements override the pair-derived cost of those axes.

Each size is timed ``iters`` times after ``warmup``, small sizes for the
latency and large ones for the bandwidth. The fastest iteration is kept:
scheduling stalls and outside interference only ever add time, while the
contention of a round's concurrent transfers slows every iteration and so
stays in the estimate. Times are fitted by least squares (relative
residuals) to t = alpha + volume / bandwidth. On GPUs the timing uses CUDA
events on the current stream, which waits for the communication stream
before the end event (``work.wait()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import platform
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from numpy.typing import ArrayLike

from automap.cluster.cluster import Cluster, Device
from automap.cluster.device import measure_concurrently, measure_device_profile
from automap.cluster.topology import (
    DEFAULT_REL_TOL,
    GroupLink,
    Topology,
    candidate_meshes,
    fit_tiers,
    significant_rel_tol,
)
from automap.cluster.workspace import measure_library_workspace_bytes
from automap.errors import AutomapError
from automap.progress import stage
from automap.sharding.mesh import DeviceMesh

log = logging.getLogger(__name__)

#: Message sizes: two small ones fix the latency, three large ones the bandwidth.
DEFAULT_CPU_SIZES_BYTES = (8, 4096, 256 * 1024, 1 << 20, 4 << 20)
DEFAULT_GPU_SIZES_BYTES = (8, 65536, 4 << 20, 16 << 20, 64 << 20)
CONTENTION_REPEATS = 3
#: Compute ahead of each all-reduce when a mesh's latency is measured as training
#: meets it (``measure_mesh(load_flops=)``, ``autoparallelize``'s measured links,
#: ``detect_cluster``'s mesh axes): about the work between two collectives of a
#: sharded step of a small model. A collective in a step waits for the slowest
#: rank; where ranks share cores that wait (the skew of their schedules) dwarfs
#: the idle latency: 4 gloo ranks on 2 cores measured 1.1-8 ms idle and 8-11 ms
#: after 1e9 FLOPs each (stop 28).
TRAINING_LOAD_FLOPS = 5e8


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair of ``range(n)`` once
    (circle method): n-1 rounds for even n, n for odd n (one rank idle)."""
    if n < 2:
        return []
    m = n + (n % 2)  # odd n: a phantom rank m-1; its partner sits the round out
    rounds = []
    for r in range(m - 1):
        pairs = [(r, m - 1)]
        pairs += [((r + i) % (m - 1), (r - i) % (m - 1)) for i in range(1, m // 2)]
        rounds.append(sorted((min(a, b), max(a, b)) for a, b in pairs if max(a, b) < n))
    return rounds


def fit_alpha_bandwidth(volume_bytes: ArrayLike, times_s: ArrayLike
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares fit of t = alpha + volume / bandwidth with relative
    residuals (so the small sizes fix alpha and the large ones the bandwidth),
    vectorised over the leading axes of ``times_s`` (``(..., len(volume))``).

    Constrained to 0 <= alpha <= the fastest time (no consistent model has a
    latency above a measured time; without this bound one slow small-size
    sample would inflate alpha and, through the slope, the bandwidth). If
    the times do not grow with the size, all time is charged to bandwidth
    (alpha 0): the conservative reading of a size dependence lost in noise."""
    x = np.asarray(volume_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    a = 1.0 / t  # rows scaled by 1/t make the residuals relative: target 1
    b = x / t
    saa, sbb, sab = (a * a).sum(-1), (b * b).sum(-1), (a * b).sum(-1)
    sa, sb = a.sum(-1), b.sum(-1)
    det = saa * sbb - sab * sab
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = (sbb * sa - sab * sb) / det
        beta = (saa * sb - sab * sa) / det
    clipped = np.clip(np.nan_to_num(alpha), 0.0, t.min(-1))
    # With alpha on a bound, the best slope given alpha.
    beta = np.where(clipped == alpha, beta, (sb - clipped * sab) / sbb)
    flat = ~(beta > 0)
    alpha = np.where(flat, 0.0, clipped)
    beta = np.where(flat, sb / sbb, beta)
    return alpha, 1.0 / beta


def bus_bandwidth(algbw_bytes_per_s: Any, n: int) -> Any:
    """The paper's busbw = algbw * 2(n-1)/n for an all-reduce over n ranks."""
    return algbw_bytes_per_s * 2.0 * (n - 1) / n


def _all_reduce(buf: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    dist.all_reduce(buf, group=group)


def _times_s(fn: Callable[[], None], iters: int, warmup: int, device: torch.device,
             before: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn`` after ``warmup`` calls;
    ``before`` runs untimed ahead of each call."""
    before = before or (lambda: None)
    for _ in range(warmup):
        before()
        fn()
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in events:
            before()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in events]
    times = []
    for _ in range(iters):
        before()
        start_s = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start_s)
    return times


def _barrier(device: torch.device) -> None:
    # On NCCL, name the device: the barrier's tensor goes there.
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


class _Bench:
    """This rank's buffers and timed operations; each returns the seconds of
    every iteration of every size."""

    def __init__(self, sizes_bytes: Sequence[int], iters: int, warmup: int,
                 device: torch.device) -> None:
        self.sizes_bytes = sizes_bytes
        self.iters, self.warmup, self.device = iters, warmup, device
        numel = max(sizes_bytes) // 4
        self.send = torch.ones(numel, dtype=torch.float32, device=device)
        self.recv = torch.empty(numel, dtype=torch.float32, device=device)

    def _sync(self) -> None:
        # Align all ranks so concurrent measurements really overlap.
        _barrier(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def exchange(self, peer: int | None, sizes_bytes: Sequence[int] | None = None
                 ) -> list[list[float]] | None:
        """A bidirectional exchange with ``peer`` (None: idle, but still in
        the barriers) at each of ``sizes_bytes`` (default: all sizes)."""
        times = []
        for size in sizes_bytes or self.sizes_bytes:
            self._sync()
            if peer is None:
                continue
            send, recv = self.send[: size // 4], self.recv[: size // 4]

            def exchange(send: torch.Tensor = send, recv: torch.Tensor = recv) -> None:
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            times.append(_times_s(exchange, self.iters, self.warmup, self.device))
        return None if peer is None else times

    def all_reduce(self, group: Any, load_flops: float = 0.0,
                   sizes_bytes: Sequence[int] | None = None) -> list[list[float]]:
        """All-reduce times per size (default: all sizes); with ``load_flops``,
        each call follows that much matmul work on every rank, as a collective
        follows compute in a training step (the call then also waits for the
        slowest rank)."""
        n = 256
        a = torch.randn(n, n, device=self.device)
        matmuls = math.ceil(load_flops / (2 * n**3))

        def load() -> None:
            for _ in range(matmuls):
                a @ a

        times = []
        for size in sizes_bytes or self.sizes_bytes:
            self._sync()
            buf = self.send[: size // 4]
            times.append(
                _times_s(functools.partial(_all_reduce, buf, group), self.iters,
                         self.warmup, self.device, load if matmuls else None)
            )
        return times


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: the architecture is all we know
    return platform.processor() or platform.machine()


def _this_device(device: torch.device, measure_profile: bool) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory_bytes = props.name, int(props.total_memory)
    else:
        name, memory_bytes = _cpu_name(), None
    profile = measure_device_profile(device) if measure_profile else None
    return {
        "host": socket.gethostname(),
        "kind": device.type,
        "name": name,
        "memory_bytes": memory_bytes,
        "sustained_flops_per_s": profile.flops_per_s if profile else None,
        "memory_bandwidth_bytes_per_s": profile.memory_bandwidth_bytes_per_s if profile else None,
        "op_overhead_s": profile.op_overhead_s if profile else None,
        "library_workspace_bytes": (measure_library_workspace_bytes(device)
                                    if device.type == "cuda" else None),
    }


def _pair_samples(records: list[dict], key: str) -> dict[tuple[int, int], np.ndarray]:
    """Per pair (a < b), the iteration times of both ends: repeats x sizes x 2*iters."""
    samples: dict[tuple[int, int], list] = {}
    for rank, record in enumerate(records):
        for peer, times in record[key].items():
            samples.setdefault((min(rank, peer), max(rank, peer)), []).append(np.array(times))
    return {pair: np.concatenate(ends, axis=-1) for pair, ends in samples.items()}


def detect_cluster(
    *,
    sizes_bytes: Sequence[int] | None = None,
    iters: int = 5,
    warmup: int = 1,
    repeats: int = 3,
    measure_groups: int = 3,
    measure_profile: bool = True,
    rel_tol: float | None = None,
    quiet: bool = False,
    load_flops: float = TRAINING_LOAD_FLOPS,
) -> Cluster:
    """Measure the cluster of the initialised default process group.

    Collective: every rank calls it with the same arguments and gets the
    same ``Cluster`` (on NCCL, after ``torch.cuda.set_device``).
    ``sizes_bytes``: message sizes, multiples of 4 (default
    ``DEFAULT_GPU_SIZES_BYTES`` on NCCL, ``DEFAULT_CPU_SIZES_BYTES``
    otherwise). ``measure_groups``: how many of the best candidate meshes get
    their axes measured by group all-reduces. ``repeats``: runs of the pair
    tournament; each pair's latency and bandwidth is the median of its runs.
    ``measure_profile``: measure each device's profile
    (``automap.cluster.device``), every rank at once as in training.
    ``rel_tol``: tier tolerance; None takes ``significant_rel_tol`` of the
    repeats (at least ``DEFAULT_REL_TOL``), so that noise does not split a
    tier. ``quiet``: no progress (rank 0 logs each phase on the ``automap``
    logger, ``automap.progress``). ``load_flops`` (0: idle): each measured axis's latency is its
    smallest all-reduce after that much compute on every rank, as training
    meets it (``measure_mesh``); the pair tournament, which fits the tiers,
    stays idle.
    Keep ``warmup >= 1`` on NCCL: the first exchange of a pair creates its
    communicator.

    The returned ``Cluster.measurement`` holds the settings, ``noise_rel``
    (the pooled repeat-to-repeat standard deviation of log pair bandwidths),
    ``contention`` (pair bandwidth per number of concurrent pairs),
    ``groups`` (per measured axis: its fit, and time, algbw and busbw per
    size), and ``phase_s`` / ``wall_s`` (rank 0's clock).

    Work: ``repeats`` x N-1 (odd N: N) rounds of ``len(sizes_bytes) * (warmup + iters)``
    concurrent exchanges, 3 * ceil(log2(N/2) + 1) rounds of ``warmup + iters``
    exchanges of the largest size, one all-reduce series per distinct axis
    of the measured candidates, and the device profile (about 0.1 s on a
    CPU; measured once more, the first rank alone and then every rank, for
    ``shared_slowdown`` as ``measure_concurrently`` does): time grows as O(N)."""
    if not dist.is_available() or not dist.is_initialized():
        raise AutomapError(
            "detect_cluster needs an initialised torch.distributed process group: run it "
            "under torchrun, or use `automap detect --local N`"
        )
    rank, n = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if sizes_bytes is None:
        sizes_bytes = DEFAULT_GPU_SIZES_BYTES if on_gpu else DEFAULT_CPU_SIZES_BYTES
    sizes_bytes = tuple(int(s) for s in sizes_bytes)
    if len(set(sizes_bytes)) < 2 or any(s < 4 or s % 4 for s in sizes_bytes):
        raise AutomapError(f"need two or more sizes, multiples of 4 bytes; got {sizes_bytes}")
    if iters < 1 or warmup < 0 or repeats < 1:
        raise AutomapError(f"need iters >= 1, warmup >= 0 and repeats >= 1, got {iters}, "
                           f"{warmup} and {repeats}")
    sizes = np.array(sizes_bytes, dtype=np.float64)
    bench = _Bench(sizes_bytes, iters, warmup, device)
    rounds = round_robin(n)
    concurrency = _contention_steps(len(rounds[0]) if rounds else 0)
    shown = rank == 0 and not quiet  # rank 0 reports for all
    phase_s: dict[str, float] = {}
    wall_start = time.perf_counter()

    def lap(phase: str) -> None:
        phase_s[phase] = time.perf_counter() - wall_start - sum(phase_s.values())

    with stage(log, "measured the device profiles", enabled=shown):
        _barrier(device)  # every rank measures at once: the device under full load
        record: dict = {"device": _this_device(device, measure_profile), "pairs": {},
                        "contention": {}}
        # Whether ranks share their compute (a pipeline's ranks speed up in its
        # bubbles then): the first rank alone against every rank at once.
        record["device"]["shared_slowdown"] = (
            measure_concurrently(device).shared_slowdown if measure_profile else None)
    lap("device")
    with stage(log, f"measured the pairs of {n} ranks ({repeats} x {len(rounds)} rounds)",
               total=repeats * len(rounds), enabled=shown) as pairs_stage:
        for repeat, (r, pairs) in itertools.product(range(repeats), enumerate(rounds)):
            peer = _partner(rank, pairs)
            times = bench.exchange(peer)
            if times is not None:
                record["pairs"].setdefault(peer, []).append(times)
            pairs_stage.advance(f"run {repeat + 1}/{repeats} round {r + 1}/{len(rounds)}")
    lap("pairs")
    with stage(log, "measured contention", total=CONTENTION_REPEATS * len(concurrency),
               enabled=shown) as contention_stage:
        for repeat, k in itertools.product(range(CONTENTION_REPEATS), concurrency):
            peer = _partner(rank, rounds[0][:k])
            times = bench.exchange(peer, (max(sizes_bytes),))
            if times is not None:
                record["contention"][(repeat, k, peer)] = times[0]
            contention_stage.advance(f"{k} pairs")
    lap("contention")
    records: list = [None] * n
    dist.all_gather_object(records, record)

    pair_samples = _pair_samples(records, "pairs")
    alpha, bandwidth, log_repeats = _pair_matrices(pair_samples, n, sizes)
    noise = float(np.sqrt(np.mean(np.var(log_repeats, axis=1, ddof=1)))) \
        if log_repeats.shape[1] > 1 and len(log_repeats) else 0.0
    if rel_tol is None:
        rel_tol = significant_rel_tol(log_repeats, DEFAULT_REL_TOL)
    partitions = _axis_partitions(fit_tiers(alpha, bandwidth, rel_tol), measure_groups)
    group_links, group_rows = [], []
    with stage(log, f"measured mesh axes by group all-reduce ({len(partitions)})",
               total=len(partitions), enabled=shown) as groups_stage:
        for partition in partitions:
            link, row = _measure_partition(bench, partition, sizes)
            if load_flops > 0:
                link = _loaded(link, bench, load_flops)
                row["idle_alpha_s"], row["alpha_s"] = row["alpha_s"], link.alpha_s
            group_links.append(link)
            group_rows.append(row)
            groups_stage.advance()
    lap("groups")
    # Rank 0's clock for everyone: every rank returns the same Cluster.
    timing = [phase_s, time.perf_counter() - wall_start]
    dist.broadcast_object_list(timing, src=0)

    measurement = {
        "backend": dist.get_backend(),
        "world_size": n,
        "sizes_bytes": list(sizes_bytes),
        "iters": iters,
        "warmup": warmup,
        "repeats": repeats,
        "pair_rounds": len(rounds),
        "noise_rel": noise,
        "contention": _contention_rows(records, concurrency, max(sizes_bytes)),
        "groups": group_rows,
        "torch": torch.__version__,
        "phase_s": timing[0],
        "wall_s": timing[1],
    }
    return Cluster(
        _devices(records),
        alpha,
        bandwidth,
        group_links=group_links,
        rel_tol=rel_tol,
        measurement=measurement,
    )


def _partner(rank: int, pairs: Sequence[tuple[int, int]]) -> int | None:
    for a, b in pairs:
        if rank in (a, b):
            return b if rank == a else a
    return None


def _contention_steps(max_pairs: int) -> list[int]:
    """1, 2, 4, ... concurrent pairs, ending with all of them."""
    steps, k = [], 1
    while k < max_pairs:
        steps.append(k)
        k *= 2
    return steps + [max_pairs] if max_pairs else []


def _pair_matrices(samples: dict, n: int, sizes: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N x N latency and bus bandwidth: per pair, a fit on the fastest times of
    each repeat, then the median over the repeats. Also the log bandwidth of
    every pair's repeats (pairs x repeats), whose spread is the noise."""
    alpha = np.zeros((n, n))
    bandwidth = np.zeros((n, n))
    if not samples:
        return alpha, bandwidth, np.zeros((0, 1))
    pairs = list(samples)
    fastest = np.array([samples[p].min(axis=-1) for p in pairs])  # pairs x repeats x sizes
    alphas, bandwidths = fit_alpha_bandwidth(sizes, fastest)  # pairs x repeats
    a, b = np.array(pairs).T
    alpha[a, b] = np.median(alphas, axis=1)
    bandwidth[a, b] = np.median(bandwidths, axis=1)
    alpha[b, a], bandwidth[b, a] = alpha[a, b], bandwidth[a, b]
    return alpha, bandwidth, np.log(bandwidths)


def _devices(records: list[dict]) -> list[Device]:
    seen: dict[str, int] = {}
    devices = []
    for rank, record in enumerate(records):
        info = record["device"]
        local_rank = seen.get(info["host"], 0)
        seen[info["host"]] = local_rank + 1
        devices.append(Device(rank=rank, local_rank=local_rank, **info))
    return devices


def _axis_partitions(topology: Topology, count: int) -> list[list[list[int]]]:
    """The distinct axis partitions (groups > 1 device) of the best ``count``
    candidate meshes."""
    found: dict[frozenset, list[list[int]]] = {}
    for candidate in candidate_meshes(topology)[:count]:
        mesh = candidate.mesh
        for axis in range(mesh.ndim):
            if mesh.shape[axis] > 1:
                groups = mesh.axis_groups(axis)
                found.setdefault(frozenset(frozenset(g) for g in groups), groups)
    return list(found.values())


def measure_mesh(mesh: DeviceMesh, sizes_bytes: Sequence[int] = DEFAULT_CPU_SIZES_BYTES,
                 iters: int = 5, warmup: int = 1, load_flops: float = 0.0) -> DeviceMesh:
    """``mesh`` with every axis's latency and bus bandwidth measured now: an
    all-reduce series on all of the axis's groups at once, fitted on each
    size's median iteration (what a training step meets, interference from
    whatever else runs included; ``detect_cluster`` keeps the fastest). With
    ``load_flops``, the latency is the smallest size's all-reduce (its
    median) when every call follows that much compute on every rank, so that
    it includes waiting for the slowest rank, as a collective in a training
    step does; the bandwidth is the idle series' (a loaded fit's is noise).
    Collective over the default process group."""
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    bench = _Bench(tuple(int(s) for s in sizes_bytes), iters, warmup, device)
    sizes = np.array(sizes_bytes, dtype=np.float64)
    alpha, bandwidth = [], []
    for axis in range(mesh.ndim):
        if mesh.shape[axis] == 1:
            alpha.append(mesh.alpha_s[axis])
            bandwidth.append(mesh.bandwidth_bytes_per_s[axis])
            continue
        link, _ = _measure_partition(bench, mesh.axis_groups(axis), sizes, np.median)
        if load_flops > 0:
            link = _loaded(link, bench, load_flops)
        alpha.append(link.alpha_s)
        bandwidth.append(link.bandwidth_bytes_per_s)
    return DeviceMesh(mesh.shape, ranks=mesh.ranks, axis_names=mesh.axis_names, alpha_s=alpha,
                      bandwidth_bytes_per_s=bandwidth, backend=mesh.backend)


def _loaded(link: GroupLink, bench: _Bench, load_flops: float) -> GroupLink:
    """``link`` with the latency of its groups' smallest all-reduce (the median,
    slowest group) when each call follows ``load_flops`` of compute on every rank:
    the wait for the slowest rank that a training step's collectives meet (never
    below the idle fit's latency). Collective over the default group."""
    partition = [list(g) for g in link.groups]
    smallest = min(bench.sizes_bytes)
    with _partition_group(partition) as group:
        mine = bench.all_reduce(group, load_flops, (smallest,))[0]
    size = len(partition[0])
    volume = smallest * 2.0 * (size - 1) / size
    alpha_s = _slowest_group_median(partition, mine) - volume / link.bandwidth_bytes_per_s
    return dataclasses.replace(link, alpha_s=max(link.alpha_s, alpha_s))


@contextlib.contextmanager
def _partition_group(partition: list[list[int]]) -> Iterator[Any]:
    """The process group of this rank's part of ``partition`` (one subgroup per
    part; None: the default group, when one part holds the world), destroyed after."""
    if len(partition[0]) == dist.get_world_size():
        yield None
        return
    group, subgroups = dist.new_subgroups_by_enumeration(partition)
    try:
        yield group
    finally:
        for g in subgroups:
            dist.destroy_process_group(g)


def _slowest_group_median(partition: list[list[int]], mine: list[float]) -> float:
    """The largest over ``partition``'s groups of the median of its ranks' times
    (``mine``: this rank's); collective over the default group."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return max(float(np.median([t for r in g for t in gathered[r]])) for g in partition)


def _measure_partition(bench: _Bench, partition: list[list[int]], sizes: np.ndarray,
                       pick: Callable[..., Any] = np.min) -> tuple[GroupLink, dict]:
    """All-reduce on every group of ``partition`` at once; the slowest
    group's fit (on the iteration ``pick`` chooses per size) as a
    ``GroupLink``, and algbw/busbw per size for the record."""
    n = dist.get_world_size()
    size = len(partition[0])
    with _partition_group(partition) as group:
        mine = bench.all_reduce(group)
    gathered: list = [None] * n
    dist.all_gather_object(gathered, mine)
    times = np.array(
        [pick(np.concatenate([gathered[r] for r in g], axis=1), axis=1) for g in partition]
    )
    factor = 2.0 * (size - 1) / size
    alpha, busbw = fit_alpha_bandwidth(sizes * factor, times)
    worst = times.max(axis=0)
    link = GroupLink(tuple(tuple(g) for g in partition), float(alpha.max()), float(busbw.min()))
    row = {
        "groups": [list(g) for g in partition],
        "alpha_s": link.alpha_s,
        "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
        "time_s": worst.tolist(),
        "algbw_bytes_per_s": (sizes / worst).tolist(),
        "busbw_bytes_per_s": bus_bandwidth(sizes / worst, size).tolist(),
    }
    return link, row


def _contention_rows(records: list[dict], steps: list[int], size_bytes: int) -> list[dict]:
    """Per number of concurrent pairs: the pair bandwidth S / t at the
    largest size, median over the active pairs and the repeats."""
    rows = []
    for k in steps:
        per_repeat: dict[int, list[float]] = {}
        for record in records:
            for (repeat, steps_k, _), times in record["contention"].items():
                if steps_k == k:
                    per_repeat.setdefault(repeat, []).append(size_bytes / min(times))
        rows.append({
            "concurrent_pairs": k,
            "bandwidth_bytes_per_s": float(
                np.median([np.median(v) for v in per_repeat.values()])
            ),
        })
    return rows
