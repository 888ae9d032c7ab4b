"""The predicted step time of a plan, on one timeline: the forward, then the
backward with the data-parallel gradient buckets all-reduced alongside it,
then the optimizer step.

Per node, the chosen strategy's compute (split between forward and backward
by its profiled FLOPs), its own collectives and the layout conversions into
it run in order on the compute stream. Gradients that the generated program
leaves to ``GradientSync`` (``generate/grad_sync.py``: a parameter read as
stored by every use, each reducing its gradient over the same mesh axes) are
packed by the same rule (``DEFAULT_BUCKET_BYTES``, one open bucket per set of axes, in
reverse order of first use); a bucket is ready when the backward has passed
the first use of each of its parameters, and the buckets' all-reduces run one
at a time on a communication stream beside the backward. The step waits for
the last bucket, then runs the optimizer on every parameter shard.

The ILP prices these terms linearly: every gradient all-reduced on its own
and in full, nothing overlapped. ``sequential_s`` is this timeline without
the overlap. Readers of one activation that share its gradient all-reduce
(``solve/shared_gradients.py``) pay it once, in the ILP and here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from automap.sharding.collectives import DEFAULT_BUCKET_BYTES
from automap.solve.fsdp import fused_backward_delta_s, parameter_grad_axes
from automap.solve.gradient_buckets import deferred_with_readers, gradient_buckets
from automap.solve.shared_gradients import table_shared_gradients
from automap.solve.strategies import ShardCounts

#: Forward share of a node's work when the profiler counts no FLOPs for it
#: (elementwise ops): the forward moves 2 of the 5 tensors an elementwise op
#: with a gradient moves (x, y forward; dy, x, dx backward).
FORWARD_SHARE_WITHOUT_FLOPS = 0.4


@dataclass
class StepTime:
    forward_s: float
    backward_s: float
    recompute_s: float
    gradient_sync_s: float  # the buckets' all-reduces, overlapped or not
    exposed_sync_s: float  # the part of them that the backward does not hide
    optimizer_s: float
    buckets: int

    @property
    def step_s(self) -> float:
        return (self.forward_s + self.recompute_s + self.backward_s + self.exposed_sync_s
                + self.optimizer_s)

    @property
    def sequential_s(self) -> float:
        """The same terms added up without overlap."""
        return (self.forward_s + self.recompute_s + self.backward_s + self.gradient_sync_s
                + self.optimizer_s)

    def to_dict(self) -> dict:
        return {**asdict(self), "step_s": self.step_s, "sequential_s": self.sequential_s}


def shared_gradient_savings(table, choice) -> dict[str, float]:
    """Per node, the seconds of gradient all-reduce its strategy prices that
    another reader of the same activation runs for it (the readers after the
    first of each ``solve/shared_gradients.py`` group). A parameter's group whose
    all-reduce a bucket runs is left out: those readers' all-reduces are taken
    out whole (``node_times``) and priced in the buckets."""
    saved: dict[str, float] = {}
    bucketed = {edge[0] for _, _, edges in deferred_with_readers(table, choice).values()
                for edge in edges}
    for group in table_shared_gradients(table, choice):
        if group.producer in bucketed:
            continue
        cost = table.mesh.all_reduce_cost_s(group.local_bytes, group.axes)
        for consumer, _ in group.readers[1:]:
            saved[consumer] = saved.get(consumer, 0.0) + cost
    return saved


def recomputed_forwards(checkpoint) -> dict[str, int]:
    """Per node, how many times a checkpoint schedule runs its forward again."""
    if checkpoint is None:
        return {}
    forwards: dict[int, int] = {}
    for op, stage, _ in checkpoint.timeline:
        if op.startswith("forward"):
            forwards[stage] = forwards.get(stage, 0) + 1
    counts: dict[str, int] = {}
    for stage, runs in forwards.items():
        for name in checkpoint.stages[stage]:
            counts[name] = counts.get(name, 0) + runs - 1
    return counts


@dataclass
class NodeTime:
    """One node's seconds under a choice: its own forward and backward (compute
    and collectives, the deferred gradient all-reduces taken out), and the
    conversions into it, as often as their edges occur and once."""

    forward_s: float
    backward_s: float
    into_forward_s: float = 0.0
    into_backward_s: float = 0.0
    into_forward_once_s: float = 0.0


def node_times(profile, table, choice, edge_weight=None) -> dict[str, NodeTime]:
    """``NodeTime`` of every node (graph order) of the strategies ``choice``
    picks from ``table``; ``edge_weight``: how often each edge occurs."""
    edge_weight = edge_weight or {}
    mesh = table.mesh
    times = {name: NodeTime(0.0, 0.0) for name in table.nodes}
    for edge, _, _, path in table.conversions(choice):
        t, w = times[edge[2]], edge_weight.get(edge, 1.0)
        backward_s = path.backward_cost_s
        grad_axes = parameter_grad_axes(table, edge[0], edge[2], edge[3], [choice[edge[2]]])
        if grad_axes is not None:  # a sharded parameter's gather, fused (solve/fsdp.py)
            info = table.nodes[edge[0]].outputs[edge[1]]
            backward_s += fused_backward_delta_s(mesh, str(path.src), str(path.dst), info.shape,
                                                 info.dtype_bytes, grad_axes[0])
        t.into_forward_s += w * path.forward_cost_s
        t.into_backward_s += w * backward_s
        t.into_forward_once_s += path.forward_cost_s
    # Reads whose gradient all-reduce a bucket runs instead: of the parameter,
    # its cast, or a part computed from state alone (priced on what it read).
    deferred_reads: dict[tuple[str, int], tuple] = {}
    for axes, _, edges in deferred_with_readers(table, choice).values():
        for producer, o, consumer, k in edges:
            deferred_reads.setdefault((consumer, k), (producer, o, axes))
    shard_count = ShardCounts(mesh)
    shared_s = shared_gradient_savings(table, choice)
    for name, node in table.nodes.items():
        c = choice[name]
        prof = profile.by_name.get(name) if profile is not None else None
        flops = (prof.fwd_flops + prof.bwd_flops) if prof is not None else 0
        share = prof.fwd_flops / flops if flops else FORWARD_SHARE_WITHOUT_FLOPS
        compute = float(node.compute_s[c])
        bwd_comm = float(node.backward_comm_s[c]) - shared_s.get(name, 0.0)
        for k in range(len(node.inputs)):
            if (name, k) in deferred_reads:  # all-reduced in a bucket, not by the node
                producer, o, axes = deferred_reads[(name, k)]
                source = table.nodes[producer]
                nbytes = source.outputs[o].nbytes / shard_count(
                    source.out_specs[choice[producer]][o])
                bwd_comm -= mesh.all_reduce_cost_s(nbytes, axes)
        times[name].forward_s = compute * share + float(node.forward_comm_s[c])
        times[name].backward_s = compute * (1 - share) + max(bwd_comm, 0.0)
    return times


def step_time(profile, table, choice, node_weight=None, edge_weight=None, checkpoint=None,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> StepTime:
    """The overlapped step time of the strategies ``choice`` picks from
    ``table`` (see the module docstring). ``node_weight`` / ``edge_weight``:
    how often each node or edge occurs in the real model (depth-reduced
    planning); a ``checkpoint`` plan's recomputed forwards (with their
    collectives and conversions) run at the start of the backward."""
    node_weight = node_weight or {}
    mesh = table.mesh
    times = node_times(profile, table, choice, edge_weight)
    buckets, first_use = gradient_buckets(table, choice, node_weight, bucket_bytes)
    recomputed = recomputed_forwards(checkpoint)
    forward = optimizer = recompute_s = 0.0
    backward: list[tuple[str, float]] = []  # per node in graph order
    for name, node in table.nodes.items():
        t, w = times[name], node_weight.get(name, 1.0)
        forward += w * t.forward_s + t.into_forward_s
        recompute_s += recomputed.get(name, 0) * (t.forward_s + t.into_forward_once_s)
        backward.append((name, w * t.backward_s + t.into_backward_s))
        if node.optimizer_s is not None:
            optimizer += w * float(node.optimizer_s[choice[name]])

    # When the backward passes each node (it runs the nodes in reverse order).
    clock = forward + recompute_s
    done_at: dict[str, float] = {}
    for name, seconds in reversed(backward):
        clock += seconds
        done_at[name] = clock
    compute_end = clock

    # One communication stream: each bucket starts when it is ready and the
    # previous one is done.
    ready = [max(done_at[first_use[p]] for p in b.params) for b in buckets]
    sync = stream_free = 0.0
    for start, bucket in sorted(zip(ready, buckets), key=lambda rb: rb[0]):
        cost = mesh.all_reduce_cost_s(bucket.nbytes, bucket.axes)
        sync += cost
        stream_free = max(stream_free, start) + cost
    exposed = max(0.0, stream_free - compute_end)
    return StepTime(forward, compute_end - forward - recompute_s, recompute_s, sync, exposed,
                    optimizer, len(buckets))
