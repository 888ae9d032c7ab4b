"""A training step of the generated program on FakeTensors: the memory one rank
uses, exactly as the program allocates it, without devices or a process group.

The rank's module is assembled as ``generate`` assembles it (same graph passes,
checkpoint regions, bucketed gradient sync), with fake parameter shards and
process groups whose collectives allocate their results and send nothing
(``SimulatedGroups``). One step creates the optimizer state; the next is
recorded: the storage of every tensor any op returns is followed from birth to
death (``automap.trace.profiling.TrackStorage``, kernel scratch included), so
the peak is the peak of live tensor bytes a real step of this rank reaches.

This is the oracle the planner's memory model is checked against (and that
``automap.plan(..., verify=True)`` runs on the chosen plan)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from automap.generate.grad_sync import DEFAULT_BUCKET_BYTES
from automap.generate.program import assemble
from automap.sharding.collectives import buffer_tag
from automap.sharding.process_groups import SimulatedGroups
from automap.sharding.spec import ShardingSpec
from automap.trace.cpu_on_meta import checkpoints_as_on_cpu, run_cpu_kernels, step_on_meta
from automap.trace.fake_mode import StorageFaithfulFakeMode
from automap.trace.profiling import (
    TrackStorage,
    create_optimizer_state,
    make_optimizer,
    optimizer_tensors,
)

#: The categories of ``SimulatedStep.breakdown``, in display order. The last,
#: ``reserve``, is the planner's (``planner/reserve.py``): 0 here.
CATEGORIES = ("parameters", "buffers", "inputs", "optimizer_state", "gradients",
              "activations", "backward", "communication", "gradient_buckets",
              "optimizer_step", "workspace", "reserve")
_PHASE_CATEGORY = {"forward": "activations", "backward": "backward",
                   "optimizer": "optimizer_step"}
#: At most this many samples in ``SimulatedStep.timeline`` (a plan stays small;
#: merged samples keep the largest, so the step's peak is always one of them).
MAX_TIMELINE_SAMPLES = 400


@dataclass
class SimulatedStep:
    """The memory of one steady-state training step of one rank, in bytes of live
    tensor storage: the peak, where it occurs (``phase``: forward, backward or
    optimizer), what is live then by category, and each phase's own peak."""

    rank: int
    peak_bytes: int
    phase: str
    breakdown: dict[str, int]
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)
    #: Live bytes over the step: per sample (the peak of one node's forward or
    #: backward, or of the optimizer step) ``at`` (the fraction of the step's
    #: storage births and deaths before it), ``phase``, ``node`` and ``bytes``
    #: (one per entry of ``CATEGORIES``, as ``breakdown``); the largest sample's
    #: bytes sum to ``peak_bytes``.
    timeline: list[dict] = field(default_factory=list)


@dataclass
class _Record:
    nbytes: int
    category: str
    born: int
    died: int | None = None
    node: str = ""  # the generated node running when it was made (forward only)


@dataclass
class _Sample:
    """The largest live total seen while one node (forward or backward) or the
    optimizer step ran, and when (the timeline's clock)."""

    phase: str
    node: str
    live: int
    clock: int
    scratch: int


class _Timeline:
    """Live storage bytes over the step, for ``TrackStorage``."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.clock = 0
        self.live = 0
        self.peak = 0
        self.peak_clock = 0
        self.peak_phase = "setup"
        self.peak_scratch = 0
        self.phase_peak: dict[str, int] = {}
        self.records: dict[int, _Record] = {}  # storage key -> live record
        self.all: list[_Record] = []
        self.node = ""
        self.peak_node = ""
        self.samples: list[_Sample] = []
        self.step_clock = (0, 0)  # the clock when the step began and ended

    def track(self, tensor: torch.Tensor, category: str | None = None) -> _Record | None:
        if tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        record = self.records.get(key)
        if record is not None:
            return record
        category = category or buffer_tag.get() or _PHASE_CATEGORY.get(self.phase, self.phase)
        self.clock += 1
        record = _Record(storage.nbytes(), category, self.clock, node=self.node)
        self.records[key] = record
        self.all.append(record)
        self.live += record.nbytes
        weakref.finalize(storage, self.free, key)
        self._observe(self.live)
        return record

    def transient(self, nbytes: int, kernel=None) -> None:
        self._observe(self.live + nbytes)  # ``kernel``: only the profile keeps it

    def _observe(self, live: int) -> None:
        if self.phase in _PHASE_CATEGORY:
            self._sample(live)
            self.phase_peak[self.phase] = max(self.phase_peak.get(self.phase, 0), live)
            if live > self.peak:
                self.peak, self.peak_clock, self.peak_phase = live, self.clock, self.phase
                self.peak_node = self.node
                self.peak_scratch = live - self.live

    def _sample(self, live: int) -> None:
        last = self.samples[-1] if self.samples else None
        if last is None or (last.phase, last.node) != (self.phase, self.node):
            self.samples.append(_Sample(self.phase, self.node, live, self.clock,
                                        live - self.live))
        elif live > last.live:
            last.live, last.clock, last.scratch = live, self.clock, live - self.live

    def free(self, key: int) -> None:
        record = self.records.pop(key, None)
        if record is not None:
            self.clock += 1
            record.died = self.clock
            self.live -= record.nbytes

    def live_at_peak(self) -> list[_Record]:
        return [r for r in self.all
                if r.born <= self.peak_clock and (r.died is None or r.died > self.peak_clock)]

    def breakdown(self, gradient_records: set[int]) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        out["workspace"] = self.peak_scratch
        for r in self.all:
            if r.born <= self.peak_clock and (r.died is None or r.died > self.peak_clock):
                category = "gradients" if id(r) in gradient_records else r.category
                out[category] = out.get(category, 0) + r.nbytes
        return out

    def sampled(self, gradient_records: set[int]) -> list[dict]:
        """The samples (at most ``MAX_TIMELINE_SAMPLES``, each window's largest)
        with their live bytes by category, as ``breakdown`` counts them at the
        peak: one sweep over births and deaths in clock order."""
        samples = self.samples
        if len(samples) > MAX_TIMELINE_SAMPLES:
            width = -(-len(samples) // MAX_TIMELINE_SAMPLES)
            samples = [max(samples[i:i + width], key=lambda s: s.live)
                       for i in range(0, len(samples), width)]
        index = {c: i for i, c in enumerate(CATEGORIES)}
        events = []
        for r in self.all:
            column = index["gradients" if id(r) in gradient_records else r.category]
            events.append((r.born, column, r.nbytes))
            if r.died is not None:
                events.append((r.died, column, -r.nbytes))
        events.sort(key=lambda e: e[0])
        live = [0] * len(CATEGORIES)
        start, end = self.step_clock
        out, e = [], 0
        for sample in samples:
            while e < len(events) and events[e][0] <= sample.clock:
                live[events[e][1]] += events[e][2]
                e += 1
            row = list(live)
            row[index["workspace"]] += sample.scratch
            out.append({"at": min(1.0, max(0.0, (sample.clock - start) / max(1, end - start))),
                        "phase": sample.phase, "node": sample.node, "bytes": row})
        return out


#: A CPU step runs on meta tensors: the same kernels' shapes and strides
#: (FakeTensors run the meta kernels too; attention's kernel is the CPU's,
#: ``trace/cpu_on_meta.py``) without FakeTensorMode's Python dispatch,
#: half the time (GPT-2 small on (2,2,2): 1.2 s against 2.0-2.7 s).
#: Other devices, fused optimizer kernels, optimizers of the user's own and
#: graphs with convolutions or recurrent layers keep FakeTensors (the program
#: asks the device's runtime; torch refuses meta; their kernels choose by device).
#: False: FakeTensors on the CPU too (what the tests check the meta step against).
SIMULATE_CPU_ON_META = True


@torch.enable_grad()
def simulate_step(traced, plan, *, rank: int | None = None, optimizer="adamw",
                  device: str | torch.device = "cpu", backend: str = "gloo",
                  local_inputs: bool = False,
                  grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                  optimizer_impl: str = "auto") -> SimulatedStep:
    """The memory of one training step of ``rank`` (default: the mesh's first) under
    ``plan`` (made for ``traced``), with ``optimizer`` as in ``automap.plan`` (its
    step's kernels ``optimizer_impl``; "auto": torch's default on ``device``) and the
    collectives of ``backend`` ("gloo" or "nccl"). The inputs are the global batch
    (this rank's shard with ``local_inputs``)."""
    device = torch.device(device)
    rank = plan.mesh.ranks[0] if rank is None else rank
    groups = SimulatedGroups(plan.mesh, rank, backend)
    timeline = _Timeline()
    meta = SIMULATE_CPU_ON_META and step_on_meta(device, traced.graph, optimizer,
                                                 optimizer_impl)
    on = torch.device("meta") if meta else device
    with contextlib.nullcontext() if on.type == "meta" else \
            StorageFaithfulFakeMode(allow_non_fake_inputs=True):
        module = assemble(traced, plan, groups, rank, on, local_inputs, grad_bucket_bytes,
                          lambda shards: fake_shards(traced, plan, shards, rank, on))
        inputs = fake_inputs(traced, plan, rank, on, local_inputs)
        params, opt = persistent_state(timeline, module, inputs, optimizer, device,
                                       optimizer_impl)
        if meta:
            run_cpu_kernels(module)
        with TrackStorage(timeline, device), generator_states_tracked(timeline, device), \
                checkpoints_as_on_cpu() if meta else contextlib.nullcontext():
            timeline.phase = "forward"
            start = timeline.clock
            outputs = _Runner(module, timeline).run(*inputs)
            loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
            timeline.phase, timeline.node = "backward", "backward"
            loss.backward()
            del loss, outputs
            return optimizer_step(timeline, rank, params, opt, start)


@contextlib.contextmanager
def generator_states_tracked(timeline: _Timeline, device: torch.device) -> Iterator[None]:
    """The CPU generator's states that ``torch.get_rng_state`` returns are
    tracked too: a checkpoint region that draws random numbers stashes one from
    its forward to its recomputation, which stashes the running one beside it
    (5 KB each). They are made outside the dispatcher, where ``TrackStorage``
    does not see them, and they are CPU memory: not tracked on other devices."""
    if device.type != "cpu":
        yield
        return
    get_state = torch.get_rng_state

    def tracked() -> torch.Tensor:
        state = get_state()
        timeline.track(state)
        return state

    torch.get_rng_state = tracked
    try:
        yield
    finally:
        torch.get_rng_state = get_state


def persistent_state(timeline: _Timeline, module, inputs, optimizer, device,
                     optimizer_impl: str = "auto"):
    """The trainable parameters and the optimizer (its state created; its step's
    kernels ``optimizer_impl``) of ``module``; parameters, buffers, ``inputs`` and
    optimizer state tracked as live for the whole step."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt, _ = make_optimizer(optimizer, params, device, optimizer_impl)
    if opt is not None:
        create_optimizer_state(opt, params)
    for kind, tensors in (("parameters", module.parameters()),
                          ("buffers", module.buffers()),
                          ("inputs", inputs),
                          ("optimizer_state", optimizer_tensors(opt))):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                timeline.track(t, kind)
    return params, opt


def optimizer_step(timeline: _Timeline, rank: int, params, opt, start: int) -> SimulatedStep:
    """After the backward: the optimizer's step on ``params`` (their gradients
    its own category), then the step's record from ``start`` (the clock at
    the step's beginning)."""
    grads = {id(timeline.records[key]) for key in
             (p.grad.untyped_storage()._cdata for p in params if p.grad is not None)
             if key in timeline.records}
    timeline.phase, timeline.node = "optimizer", "optimizer step"
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    timeline.phase = "done"
    timeline.step_clock = (start, timeline.clock)
    return SimulatedStep(rank, timeline.peak, timeline.peak_phase, timeline.breakdown(grads),
                         dict(timeline.phase_peak), timeline.sampled(grads))


class _Runner(torch.fx.Interpreter):
    """Runs the module's graph node by node, telling the timeline which node runs."""

    def __init__(self, module, timeline: _Timeline) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.timeline = timeline

    def run_node(self, n):
        self.timeline.node = n.name
        out = super().run_node(n)
        for leaf in torch.utils._pytree.tree_leaves(out):
            fn = getattr(leaf, "grad_fn", None) if isinstance(leaf, torch.Tensor) else None
            if fn is not None:  # the backward of this node tells the timeline too
                fn.register_prehook(lambda grads, name=n.name: self._backward_of(name))
        return out

    def _backward_of(self, name: str) -> None:
        self.timeline.node = f"backward of {name}"


def fake_shards(traced, plan, shards, rank: int, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, shard in shards.items():
        state = traced.parameters.get(name) or traced.buffers.get(name) or traced.constants[name]
        shape = _local_shape(shard.spec, shard.global_shape, plan.mesh, rank)
        out[name] = torch.empty(shape, dtype=state.dtype, device=device)
    return out


def fake_inputs(traced, plan, rank: int, device, local_inputs: bool) -> list:
    values = []
    placeholders = {n.name: n for n in traced.graph.nodes if n.op == "placeholder"}
    for name in traced.user_input_nodes:
        val = placeholders[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            values.append(val)
            continue
        shape = tuple(val.shape)
        node_plan = plan.nodes.get(name)
        if local_inputs and node_plan is not None:
            shape = _local_shape(node_plan.outputs[0], shape, plan.mesh, rank)
        values.append(torch.empty(shape, dtype=val.dtype, device=device))
    return values


def _local_shape(spec: str, shape, mesh, rank: int) -> tuple[int, ...]:
    bounds = ShardingSpec.parse(spec).local_slices(list(shape), mesh, rank)
    return tuple(int(b - a) for a, b in bounds)

