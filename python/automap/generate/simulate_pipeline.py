"""A training step of one pipeline stage on FakeTensors (issue 18): the memory
one rank of a pipelined plan uses, as ``simulate`` measures an intra-op plan's.

The rank's stage module is assembled as ``pipeline_stage.build_stage``
assembles it (the whole program generated on the stage's submesh, cut,
checkpoint regions, bucketed gradient sync), with fake state shards and
collectives that only allocate (``SimulatedGroups``). The schedule's order of
microbatch forwards and backwards then runs as torch's schedules run it for
this stage (``schedule_order``), with what the schedules hold:

- a received activation is a fresh buffer of the boundary's local shape,
  kept (with its gradient) until that microbatch's backward;
- what the stage sends waits for the send: GPipe waits for every forward
  send after the last forward and for every gradient send after the last
  backward (all ``M`` outputs, then all ``M`` input gradients, live at once);
  1F1B releases a forward's outputs at the next operation and keeps a
  backward's input gradients until the next backward; interleaved 1F1B (a
  rank's ``v`` chunks, each its own module, in torch's order of chunk
  operations, ``pipeline_order``), as torch's runtime schedule waits for
  its sends: a forward's outputs after that microbatch's backward on the
  chunk, every input gradient at the end of the step;
- the gradient of an output arrives as a fresh buffer before its backward;
- a recomputing stage runs its forward under a non-reentrant checkpoint;
- the data-parallel buckets are summed once after the last backward
  (``GradientSync.deferred``), the tied weights' gradients are concatenated
  and summed (an interleaved rank's copies added first), then the optimizer
  steps.

The whole batch the caller passes is live throughout on every rank (every
rank is handed it). The peak is the peak of live tensor bytes, as in
``simulate_step``."""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from torch import nn

from automap.generate.build import generate_graph
from automap.generate.grad_sync import DEFAULT_BUCKET_BYTES, GradientSync
from automap.generate.pipeline_order import schedule_order
from automap.generate.pipeline_split import cut, shared_parameters, stage_graph
from automap.generate.pipeline_stage import StagePlan, fake_values, stage_meshes
from automap.generate.program import assemble_graph
from automap.generate.simulate import (
    SimulatedStep,
    _Runner,
    _Timeline,
    fake_inputs,
    fake_shards,
    optimizer_step,
    persistent_state,
)
from automap.sharding.process_groups import SimulatedGroups
from automap.trace.fake_mode import StorageFaithfulFakeMode
from automap.trace.profiling import (
    TrackStorage,
)


@torch.enable_grad()
def simulate_stage(traced, plan, stage: int, *, position: int = 0, optimizer="adamw",
                   device: str | torch.device = "cpu", backend: str = "gloo",
                   grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                   optimizer_impl: str = "auto") -> SimulatedStep:
    """The memory of one training step of the rank at submesh ``position`` of
    pipeline ``stage`` (the submesh; interleaved: every chunk ``j`` with
    ``j mod n == stage``) under ``plan`` (``plan.pipeline`` set, its nodes made
    for ``traced``, one microbatch), with ``optimizer``, ``optimizer_impl`` and
    ``backend`` as in ``simulate_step``."""
    device = torch.device(device)
    record = plan.pipeline
    stages = record.stages
    virtual = int(getattr(record, "virtual_stages", 1))
    chunks, m = len(stages), int(record.microbatches)
    n = chunks // virtual
    meshes = stage_meshes(plan)
    rank = meshes[stage].ranks[position]
    mine = [j for j in range(chunks) if j % n == stage]
    stage_plan = StagePlan(plan, meshes[stage])
    groups = SimulatedGroups(meshes[stage], rank, backend)
    out = generate_graph(traced, stage_plan, groups, rank, device)
    stage_cut = cut(out, traced, stages)
    values = fake_values(out, traced, stage_plan, rank, device)
    parts = {j: stage_graph(out, stage_cut, j) for j in mine}
    received = {j: stage_cut.boundaries[j] if j > 0 else [] for j in mine}
    sent = {j: stage_cut.boundaries[j + 1] if j + 1 < chunks else [] for j in mine}
    # Tied weights: per set of chunks reading them, this rank's copies and
    # whether other ranks hold them too (a gloo all-reduce stages a copy).
    tied = []
    for readers in sorted(set(shared_parameters(stage_cut, out.shards).values())):
        local = [j for j in mine if j in readers]
        if local:
            names = sorted(name for name, r in shared_parameters(stage_cut, out.shards).items()
                           if r == readers)
            tied.append((names, local, len({j % n for j in readers}) > 1))
    timeline = _Timeline()
    with StorageFaithfulFakeMode(allow_non_fake_inputs=True):
        modules = {j: assemble_graph(parts[j], traced, stage_plan, groups, grad_bucket_bytes,
                                     lambda shards: fake_shards(traced, stage_plan, shards,
                                                                rank, device))
                   for j in mine}
        batch = [torch.empty((v.shape[0] * m, *v.shape[1:]), dtype=v.dtype, device=device)
                 if isinstance(v, torch.Tensor) else v
                 for v in fake_inputs(traced, stage_plan, rank, device, False)]
        params, opt = persistent_state(timeline, nn.ModuleList(list(modules.values())), batch,
                                       optimizer, device, optimizer_impl)
        inputs = [torch.chunk(v, m, dim=0) if isinstance(v, torch.Tensor) else [v] * m
                  for v in batch]

        def runner_of(module):
            runner = _Runner(module, timeline)

            def run_stage(*args):
                # The runner's environment is emptied after each call: a
                # recomputation that stops early (non-reentrant checkpoint) leaves
                # the values it made there, where the generated code's frame
                # would drop them.
                try:
                    return runner.run(*args)
                finally:
                    runner.env.clear()
            return run_stage

        with TrackStorage(timeline, device):
            start = timeline.clock
            steps = {j: _StageStep(timeline, runner_of(modules[j]),
                                   bool(getattr(stages[j], "recompute", False)),
                                   j == chunks - 1, m, schedule=record.schedule)
                     for j in mine}
            with contextlib.ExitStack() as deferred:
                for module in modules.values():
                    sync: GradientSync = module.gradient_sync  # type: ignore[assignment]
                    deferred.enter_context(sync.deferred())
                for kind, i, j in schedule_order(record.schedule, m, n, stage, virtual):
                    timeline.phase = "forward" if kind == "F" else "backward"
                    if kind == "F":
                        args = [c[i] for c in inputs] if j == 0 else \
                            [_received(values[v], device) for v in received[j]]
                        steps[j].forward(i, args)
                    else:
                        steps[j].backward(i, [_received(values[v], device, grad=True)
                                              if _needs_grad(values[v]) else None
                                              for v in sent[j]])
                timeline.phase, timeline.node = "backward", "gradient buckets"
            for one in steps.values():
                one.finish()
            for names, local, remote in tied:  # summed over the copies and ranks
                timeline.node = "tied gradients"
                flat = None
                for j in local:
                    part = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                      .reshape(-1) for p in (modules[j].get_parameter(t)
                                                             for t in names)])
                    flat = part if flat is None else flat + part
                    del part
                staged = flat.clone() if backend == "gloo" and remote else None
                del flat, staged
            return optimizer_step(timeline, rank, params, opt, start)


def _needs_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and \
        (value.is_floating_point() or value.is_complex())


def _received(value, device, grad: bool = False) -> torch.Tensor:
    """A receive buffer of ``value``'s local shape: the value (a leaf that wants a
    gradient when the value is a differentiable activation) or, with ``grad``,
    its gradient."""
    buffer = torch.empty(tuple(value.shape), dtype=value.dtype, device=device)
    return buffer if grad else buffer.requires_grad_(_needs_grad(value))


class _StageStep:
    """The stage's forwards and backwards with what the schedule keeps between
    them (see the module docstring)."""

    def __init__(self, timeline: _Timeline, run, recompute: bool, last: bool,
                 microbatches: int, schedule: str) -> None:
        self.timeline, self.run, self.recompute, self.last = timeline, run, recompute, last
        self.m, self.gpipe = microbatches, schedule == "gpipe"
        # torch's interleaved runtime waits for a forward's send after that
        # microbatch's backward on the chunk, for gradient sends at the end.
        self.runtime = schedule == "interleaved"
        self.sent_outputs: dict[int, list] = {}
        self.inputs: dict[int, list] = {}
        self.roots: dict[int, list] = {}  # outputs' gradient edges (the loss: itself)
        self.sending: list = []  # outputs waiting for their send
        self.grads_sending: list = []  # input gradients waiting for their send

    def forward(self, i: int, args: list) -> None:
        timeline = self.timeline
        timeline.phase = "forward"
        if self.recompute:
            out = torch.utils.checkpoint.checkpoint(self.run, *args, use_reentrant=False)
        else:
            out = self.run(*args)
        if self.last:
            loss = out[0] if isinstance(out, (tuple, list)) else out
            self.roots[i] = [loss.reshape(1).sum() / self.m]
        else:
            outs = [v.contiguous() for v in out]
            self.roots[i] = [torch.autograd.graph.get_gradient_edge(v) if v.requires_grad
                             else None for v in outs]
            if self.runtime:
                self.sent_outputs[i] = outs
            else:
                if not self.gpipe:
                    self.sending.clear()  # the previous forward's send completed
                self.sending.append(outs)
        self.inputs[i] = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def backward(self, i: int, grads: list) -> None:
        timeline = self.timeline
        # GPipe waits for every forward send after the last forward; 1F1B for the
        # last forward's send with this backward's receive.
        self.sending.clear()
        timeline.phase, timeline.node = "backward", f"backward of microbatch {i}"
        roots = self.roots.pop(i)
        if self.last:
            torch.autograd.backward(roots)
        else:
            pairs = [(r, g) for r, g in zip(roots, grads) if r is not None and g is not None]
            torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        del grads, roots
        inputs = self.inputs.pop(i)
        input_grads = [a.grad for a in inputs]
        del inputs
        self.sent_outputs.pop(i, None)
        if not (self.gpipe or self.runtime):
            self.grads_sending.clear()  # the previous backward's send completed
        self.grads_sending.append(input_grads)

    def finish(self) -> None:
        self.sent_outputs.clear()
        self.sending.clear()
        self.grads_sending.clear()
