"""The intra-op plan of one microbatch as a chain of units a pipeline stage
boundary may fall between, each with its per-microbatch forward and backward
seconds, its memory and the bytes that cross the cut after it.

Cuts fall where the traced graph's computed nodes (graph order) split into a
prefix and a suffix that the linearized chain (``automap.solve.linearize``)
also splits there: the prefix is exactly its first stages. Where repeated
blocks were found (``automap.solve.blocks``), only the block boundaries
(each instance's start, the end of the last) are kept, so stages hold whole
transformer layers. A depth-reduced plan's last traced block stands for the
blocks that were cut: its unit repeats that many times (each repeat with
parameters of its own), the cut between two repeats carrying what crosses
from one traced block into the next.

Per node the times follow ``automap.planner.step_time`` (the compute split by
profiled FLOPs, the node's own collectives, the conversions into it), without
the data-parallel gradient buckets: those gradients are all-reduced once per
step, after the last microbatch (``Unit.sync``, bucketed per stage). Memory
per node follows ``automap.solve.memory.plan_memory``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from automap.planner.step_time import node_times
from automap.solve.depth import instance_repeats
from automap.solve.gradient_buckets import deferred_gradients
from automap.solve.linearize import linearize
from automap.solve.memory import loop_temps, plan_memory, timeline
from automap.solve.strategies import ShardCounts


@dataclass
class Unit:
    """One unit of the chain: traced nodes ``order[first:last + 1]`` (one repeat
    of them); seconds per microbatch on one rank of a stage."""

    first: int
    last: int
    repeat: int  # which repeat of a depth-reduced block (0 otherwise)
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0  # once per step
    #: The deferred gradients it reads: key -> (mesh axes, local bytes); a
    #: stage all-reduces them in buckets (``pipeline_partition.stage_sync_s``).
    sync: dict = field(default_factory=dict)
    saved_bytes: float = 0.0  # kept from a microbatch's forward to its backward
    transient_bytes: float = 0.0  # the largest while one node runs
    #: The largest of a node's backward transient with the parameter gradients
    #: it makes: a microbatch after the first makes them anew beside the ones
    #: accumulated so far.
    accumulating_bytes: float = 0.0
    #: The most one microbatch holds of this unit while one of its nodes runs
    #: (``memory.estimate_memory``'s terms): forward, the saved tensors of the
    #: nodes before it and its transient; backward, the saved tensors of the
    #: nodes up to it, the output gradients waiting and its kernels' transient
    #: with the parameter gradients it makes beside those accumulated
    #: (``running_bytes``), or, in the chunk's first backward, where no
    #: gradient was accumulated, with those the unit's later nodes made too
    #: (``first_running_bytes``); ``made_bytes``: all the parameter gradients
    #: its backward makes. None: all its saved with its largest transient.
    running_bytes: float | None = None
    first_running_bytes: float | None = None
    made_bytes: float = 0.0
    #: Parameters and buffers it reads: key -> (bytes held the whole step,
    #: gradient bytes); a key is (placeholder, repeat). (Inputs: ``Chain.input_bytes``.)
    state: dict = field(default_factory=dict)
    #: Local bytes crossing the cut after this unit: forward, and the gradient back.
    out_bytes: float = 0.0
    out_grad_bytes: float = 0.0
    #: Of ``out_bytes``: what no node of this side of the cut saves (the sender
    #: holds it for the send), and what no node of the other side counts as
    #: saved (the receiver's buffer is extra) (``Crossing``).
    out_unsaved_bytes: float = 0.0
    out_uncounted_bytes: float = 0.0
    #: Its for-loop optimizer temporaries at their peak over its parameters,
    #: each beside what is held of the one the model's order steps before it
    #: (``memory.loop_temps``; that one may be on another rank: an over-count).
    loop_temp_bytes: float = 0.0
    #: Whether it reads a trainable parameter: a stage needs one (its rank holds
    #: something to optimise; ``pipeline_partition._stage_matrices``).
    trains: bool = True


@dataclass
class Chain:
    order: list[str]  # the traced graph's computed nodes, graph order
    units: list[Unit]
    #: Trainable parameter key -> local gradient bytes (tied weights' sync).
    grads: dict
    #: One microbatch's caller inputs (whole tensors): every rank is handed the
    #: whole batch, so each holds all the microbatches' for the whole step
    #: (``pipeline_partition``), not a unit's reader.
    input_bytes: float = 0.0
    #: The optimizer step's kernels (``StrategyTable.optimizer_impl``).
    optimizer_impl: str = "for-loop"


def cut_positions(traced, order: list[str], blocks) -> list[int]:
    """Positions ``p`` (0 < p < len(order)) where a stage may start: the first
    ``p`` nodes are exactly some first stages of the linearized chain; block
    boundaries only, when there are blocks and any falls there."""
    position = {name: i for i, name in enumerate(order)}
    stages = [[position[n] for n in stage if n in position] for stage in linearize(traced)]
    stages = [s for s in stages if s]
    cuts, seen = set(), -1
    for s in range(len(stages) - 1):
        seen = max(seen, max(stages[s]))
        rest = min(min(t) for t in stages[s + 1:])
        if seen < rest:
            cuts.add(rest)
    wanted = set()
    for block in blocks:
        spans = [[position[n] for n in inst if n in position] for inst in block.instances]
        spans = [s for s in spans if s]
        wanted.update(min(s) for s in spans)
        if spans:
            wanted.add(max(spans[-1]) + 1)
    preferred = cuts & wanted
    return sorted(preferred or cuts)


def _node_times(profile, table, choice) -> dict[str, tuple[float, float]]:
    """Per node (forward_s, backward_s) of one microbatch, conversions into it
    included, without the deferred gradients' all-reduce."""
    return {name: (t.forward_s + t.into_forward_s, t.backward_s + t.into_backward_s)
            for name, t in node_times(profile, table, choice).items()}


@dataclass
class Crossing:
    """Per cut position ``p`` (0 .. len(order)), local bytes of the computed
    tensors made before ``p`` and read at or after it: all of them (``forward``),
    their gradients (``backward``), those no node before ``p`` saves for its
    backward (``unsaved_before``: the sending stage holds them only for the
    send) and those no node from ``p`` on counts among its saved tensors
    (``uncounted_after``: the receiving stage's buffer, kept until the
    microbatch's backward, is in no saved term of its nodes)."""

    forward: np.ndarray
    backward: np.ndarray
    unsaved_before: np.ndarray
    uncounted_after: np.ndarray


def _first_saver(table, choice, producer: str, readers: list[tuple[str, int]],
                 position: dict[str, int]) -> int | None:
    """The position of the first node that saves ``producer``'s output for its
    backward, where the profile counts it (None: none saves it). The profile
    counts a saved tensor at its first saver: a reader whose saved bytes hold
    it, or, where readers save it only as a copy of an earlier node's
    (``saved_copy_inputs``) and no reader counts it, the producer itself
    (tanh, relu save their output)."""
    counted, shared = [], False
    for consumer, k in readers:
        node = table.nodes[consumer]
        per_input = node.saved_input_bytes
        if per_input is not None and per_input[choice[consumer], k] > 0:
            counted.append(position[consumer])
        shared |= producer in node.saved_copy_inputs
    if counted:
        return min(counted)
    return position[producer] if shared else None


def crossing_bytes(table, choice, order: list[str]) -> Crossing:
    """The ``Crossing`` of every cut position of ``order``."""
    position = {name: i for i, name in enumerate(order)}
    shard_count = ShardCounts(table.mesh)
    last: dict[tuple[str, int], int] = {}
    readers: dict[str, list[tuple[str, int]]] = {}
    for producer, o, consumer, k in table.edges():
        if producer in position and consumer in position:
            last[(producer, o)] = max(last.get((producer, o), -1), position[consumer])
            readers.setdefault(producer, []).append((consumer, k))
    fwd, bwd, unsaved, uncounted = (np.zeros(len(order) + 2) for _ in range(4))

    def add(into: np.ndarray, first: int, end: int, nbytes: float) -> None:
        """``nbytes`` at the cuts ``first .. end - 1``."""
        if end > first:
            into[first] += nbytes
            into[end] -= nbytes

    for (producer, o), reader in last.items():
        start = position[producer]
        if reader <= start:
            continue
        node = table.nodes[producer]
        info = node.outputs[o]
        local = info.nbytes / shard_count(node.out_specs[choice[producer]][o])
        # crosses the cuts start + 1 .. reader
        add(fwd, start + 1, reader + 1, local)
        if info.is_float:
            add(bwd, start + 1, reader + 1, local)
        saver = _first_saver(table, choice, producer, readers[producer], position)
        if saver is None:
            add(unsaved, start + 1, reader + 1, local)
            add(uncounted, start + 1, reader + 1, local)
        else:  # saved before the cuts after the saver, counted after those up to it
            add(unsaved, start + 1, min(saver, reader) + 1, local)
            add(uncounted, max(saver + 1, start + 1), reader + 1, local)
    n = len(order) + 1
    return Crossing(*(np.cumsum(a)[:n] for a in (fwd, bwd, unsaved, uncounted)))


def build_chain(traced, profile, table, choice, blocks, stacks) -> Chain:
    """The units of the plan ``choice`` picks from ``table`` (see the module
    docstring); ``blocks`` and ``stacks`` as the planner found them."""
    line = timeline(table)
    order = line.order
    memory = plan_memory(table, choice, line)
    times = _node_times(profile, table, choice)
    cuts = cut_positions(traced, order, blocks)
    crossing = crossing_bytes(table, choice, order)
    repeats = instance_repeats(blocks, list(stacks)) if stacks else {}
    deferred = deferred_gradients(table, choice)
    trained = [n for n, node in table.nodes.items()
               if node.kind == "parameter" and node.grad_bytes[choice[n]] > 0]
    shards = [float(table.nodes[n].grad_bytes[choice[n]]) for n in trained]
    loop_temp = dict(zip(trained, loop_temps(table.optimizer, table.optimizer_impl, shards),
                         strict=True))
    readers: dict[str, list[int]] = {}
    for producer, _, consumer, _ in table.edges():
        if consumer in line.position and table.nodes[producer].kind in (
                "parameter", "buffer", "constant", "input"):
            readers.setdefault(producer, []).append(line.position[consumer])
    # The output gradients live while each node runs backward (as
    # ``memory.estimate_memory``: from their last reader's backward through
    # their producer's), whichever unit made them.
    waiting = np.maximum(np.cumsum(memory.waiting[::-1])[::-1], 0.0)
    made = np.zeros(len(order))  # parameter gradient bytes each node's backward makes
    for name, positions in readers.items():
        node = table.nodes[name]
        if node.kind == "parameter":
            for p in positions:
                made[p] += float(node.grad_bytes[choice[name]])
    bounds = [0, *cuts, len(order)]
    units: list[Unit] = []
    grads: dict = {}
    for first, end in zip(bounds[:-1], bounds[1:]):
        times_repeated = max((repeats.get(order[i], 1) for i in range(first, end)), default=1)
        for rep in range(times_repeated):
            unit = Unit(first, end - 1, rep, trains=False, running_bytes=0.0,
                        first_running_bytes=0.0)
            for i in range(first, end):
                f, b = times[order[i]]
                unit.forward_s += f
                unit.backward_s += b
                unit.saved_bytes += float(memory.saved[i])
                unit.transient_bytes = max(unit.transient_bytes, float(memory.fwd[i]),
                                           float(memory.bwd[i]), float(memory.after[i]))
                unit.accumulating_bytes = max(unit.accumulating_bytes,
                                              float(memory.bwd[i]) + made[i])
            # Backward from the unit's last node: the gradients the nodes after
            # each one made are still held in the first backward.
            made_after = 0.0
            saved_upto = unit.saved_bytes
            for i in range(end - 1, first - 1, -1):
                saved_before = saved_upto - float(memory.saved[i])
                forward = saved_before + float(memory.fwd[i])
                after = saved_before + float(waiting[i]) + float(memory.after[i])
                during = saved_upto + float(waiting[i]) + float(memory.bwd[i]) + made[i]
                unit.running_bytes = max(unit.running_bytes, forward, after, during)
                unit.first_running_bytes = max(unit.first_running_bytes, forward,
                                               after + made_after + made[i],
                                               during + made_after)
                made_after += made[i]
                saved_upto = saved_before
            unit.made_bytes = made_after
            # Between repeats the cut carries what crosses into the next traced block.
            cut = first if rep < times_repeated - 1 else end
            unit.out_bytes = float(crossing.forward[cut])
            unit.out_grad_bytes = float(crossing.backward[cut])
            unit.out_unsaved_bytes = float(crossing.unsaved_before[cut])
            unit.out_uncounted_bytes = float(crossing.uncounted_after[cut])
            units.append(unit)
    # Each placeholder belongs to every unit that reads it; a tied weight (read
    # as two placeholders) is its canonical one: every stage reading it holds a
    # copy with its gradient and optimizer state.
    for name, positions in readers.items():
        canonical = table.nodes[name].tied_to or name
        node, c = table.nodes[canonical], choice[canonical]
        if node.kind == "input":
            continue  # held by every rank (``Chain.input_bytes``)
        grad = float(node.grad_bytes[c]) if node.kind == "parameter" else 0.0
        held = float(node.state_bytes[c])
        for unit in units:
            key = (canonical, unit.repeat)
            if key in unit.state or not any(unit.first <= p <= unit.last for p in positions):
                continue
            unit.state[key] = (held, grad)
            if grad <= 0:
                continue
            unit.trains = True
            grads[key] = grad
            unit.loop_temp_bytes = max(unit.loop_temp_bytes, float(loop_temp.get(canonical, 0.0)))
            if node.optimizer_s is not None:
                unit.optimizer_s += float(node.optimizer_s[c])
            if canonical in deferred:
                axes, nbytes = deferred[canonical]
                unit.sync[key] = (axes, nbytes)
    return Chain(order, units, grads, float(memory.input_bytes), table.optimizer_impl)
