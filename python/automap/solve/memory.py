"""The per-device memory of a training step under a choice of strategies: what
the generated program allocates, and when.

The step runs the graph's nodes forward in order, then backward in reverse,
then the optimizer step. With the ``NodeOptions`` columns:

- ``state_bytes`` (parameter shards with their optimizer state, buffers) and
  ``input_bytes`` (the global batch every rank is handed) live the whole step;
- a node's ``saved_bytes`` live from its forward to its backward;
- a parameter's ``grad_bytes`` appear in the backward of its last use and live
  until the optimizer step;
- ``bucket_bytes`` (data-parallel gradient bucket copies) appear in the
  backward of the node and live until the end of the backward;
- ``fwd_transient_bytes`` / ``bwd_transient_bytes`` live while the node's
  forward / backward kernels run; ``bwd_after_bytes`` (its input gradients and
  their reductions) after its backward kernels, when autograd has freed what
  the node saved;
- the gradient of a node's output lives from the backward of its last reader
  through the node's own backward (long for a residual branch);
- the optimizer step needs temporaries on top (``optimizer_temporaries``):
  its for-loop kernels some times one parameter shard beside what they still
  hold of the shard stepped before it (``loop_temp_bytes``), its foreach
  kernels some times every shard together, its fused kernels none;
- an edge whose consumer reads another spec than its producer made converts
  the tensor (``conversion_bytes``): the copy and the collective's staging live
  while the consumer's forward runs, the gradient's conversion back while its
  backward has run, and a converted parameter, or activation an earlier node
  saves too, that the consumer (or a view after it) saves for the backward is
  kept like the consumer's saved tensors (the attention output a projection
  saves: the same storage as attention's saved output, unless converted).

So, with ``S(v)`` the bytes saved by ``v`` and the nodes before it, the memory
in the forward of node ``v`` is ``state + inputs + S(v-1) + fwd_transient(v)``,
in its backward ``state + inputs + Σ_{last use of p >= v} grad_p + Σ_{u >= v}
bucket_u + max(S(v) + bwd_transient(v), S(v-1) + bwd_after(v))``, and in the
optimizer step ``state +
inputs + Σ grad + temporaries``: the peak is the largest of these. The ILP
(``automap.solve.ilp``) bounds the same expressions by the budget, the chain of
a plan (``automap.checkpoint.chain``) sums the same columns per stage, and the
simulated step of the generated program (``automap.generate.simulate``) is what
they are checked against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from automap.sharding.spec import ShardingSpec
from automap.solve.fsdp import fused_gather
from automap.solve.gradient_buckets import deferred_gradients, gradient_buckets
from automap.solve.strategies import ShardCounts

#: Temporaries of an optimizer step that runs one tensor at a time, in units of
#: the largest parameter shard (AdamW: the square root and the update of one
#: tensor; SGD works in place).
OPTIMIZER_TEMP_FACTOR = {"sgd": 0.0, "sgd_momentum": 0.0, "momentum": 0.0, "adam": 2.0,
                         "adamw": 2.0}
#: The same for the multi-tensor (foreach) kernels, in units of all parameter
#: shards together: Adam's step makes the square roots of every second moment
#: in one ``_foreach_sqrt`` and updates in place with them (torch's
#: ``_multi_tensor_adam``); the fused kernels make none.
OPTIMIZER_FOREACH_TEMP_FACTOR = {"sgd": 0.0, "sgd_momentum": 0.0, "momentum": 0.0,
                                 "adam": 1.0, "adamw": 1.0}

CATEGORIES = ("parameters and optimizer state", "inputs", "activations",
              "activation gradients", "gradients", "gradient buckets", "temporaries")


def optimizer_temporaries(optimizer, impl: str = "for-loop") -> tuple[float, float]:
    """The optimizer step's temporaries as ``(of_largest, of_all)``: factors of the
    largest parameter shard and of every shard together (``impl``: its kernels,
    ``trace.optimizer_names.OPTIMIZER_IMPLS``, resolved). No optimizer: none."""
    if optimizer is None or impl == "fused":
        return 0.0, 0.0
    name = optimizer.lower() if isinstance(optimizer, str) else "adamw"
    if impl == "foreach":
        return 0.0, OPTIMIZER_FOREACH_TEMP_FACTOR.get(name, 1.0)
    return OPTIMIZER_TEMP_FACTOR.get(name, 2.0), 0.0


#: What a for-loop step still holds of the tensor stepped before while it
#: makes one tensor's temporaries, in units of that earlier shard: Adam's
#: ``denom`` (torch's ``_single_tensor_adam`` rebinds it only once the next one
#: is made), so its step peaks at ``max_i(s_(i-1) + 2 s_i)`` over the shards
#: in the optimizer's order. Counted as ``2 max_i s_i``, a bias-free 4-layer
#: MLP's step modelled one shard (5.3 %) under its simulated peak.
OPTIMIZER_CARRY_FACTOR = {"adam": 1.0, "adamw": 1.0}


def loop_carry(optimizer, impl: str = "for-loop") -> float:
    """``OPTIMIZER_CARRY_FACTOR`` of ``optimizer`` where its step runs one
    tensor at a time with temporaries (``impl``), else 0."""
    of_largest, _ = optimizer_temporaries(optimizer, impl)
    if not of_largest:
        return 0.0
    name = optimizer.lower() if isinstance(optimizer, str) else "adamw"
    return OPTIMIZER_CARRY_FACTOR.get(name, 0.0)


def loop_temps(optimizer, impl: str, shard_bytes: Sequence[float]) -> np.ndarray:
    """Per parameter shard of ``shard_bytes`` (in the order the optimizer steps
    them: the model's ``parameters()`` order), a for-loop step's temporaries
    while it steps that one; zeros for other kernels."""
    of_largest, _ = optimizer_temporaries(optimizer, impl)
    shards = np.asarray(shard_bytes, dtype=float)
    before = np.concatenate([[0.0], shards[:-1]])
    return of_largest * shards + loop_carry(optimizer, impl) * before


def loop_temp_bytes(optimizer, impl: str, shard_bytes: Sequence[float]) -> float:
    """A for-loop step's temporaries at their peak (``loop_temps``' largest)."""
    return float(loop_temps(optimizer, impl, shard_bytes).max(initial=0.0))


def optimizer_temp_bytes(optimizer, impl: str, shard_bytes: Sequence[float],
                         all_bytes: float) -> float:
    """The temporaries of ``optimizer``'s step with ``impl``'s kernels over the
    parameter shards ``shard_bytes`` (in the optimizer's order), all together
    ``all_bytes``."""
    _, of_all = optimizer_temporaries(optimizer, impl)
    return loop_temp_bytes(optimizer, impl, shard_bytes) + of_all * all_bytes


@dataclass
class Timeline:
    """Where each node's memory sits on the step: the position of every op node
    (graph order), of every trainable parameter's gradient (its last use), and
    the edges whose converted copy is saved for the backward on top of what the
    consumer's saved bytes count (``NodeOptions.saved_copy_inputs``)."""

    order: list[str]
    position: dict[str, int]
    grad_position: dict[str, int]
    saved_copy_edges: set[tuple[str, int, str, int]]
    #: Per node whose output a later node reads, the position of its last reader:
    #: the output's gradient waits from there through the node's backward.
    last_reader: dict[str, int]

    def __len__(self) -> int:
        return len(self.order)


def timeline(table) -> Timeline:
    order = [name for name, node in table.nodes.items()
             if node.op != "placeholder" and node.kind != "output"]
    position = {name: i for i, name in enumerate(order)}
    grad_position: dict[str, int] = {}
    for producer, _, consumer, _ in table.edges():
        if table.nodes[producer].kind == "parameter" and consumer in position:
            # Autograd holds a tied weight's gradient from its first read's
            # backward until it sums every read's (GPT-2's LM head's share of
            # the embedding's gradient, from the head's backward on: 16 KiB the
            # model matrix's GPT-2 on (2,2,2) held uncounted, 1.8 % of its peak).
            trained = table.nodes[producer].tied_to or producer
            for name in {producer, trained}:
                grad_position[name] = max(grad_position.get(name, 0), position[consumer])
    for name, node in table.nodes.items():
        if node.kind == "parameter":
            grad_position.setdefault(name, 0)
    users: dict[str, list[str]] = {}
    for producer, _, consumer, _ in table.edges():
        users.setdefault(producer, []).append(consumer)

    def saves(reader: str, read: str, depth: int = 0) -> bool:
        """Whether ``reader`` saves what it reads from ``read``, itself or through
        views after it."""
        node = table.nodes[reader]
        if read in node.saved_copy_inputs:
            return True
        return node.kind == "view" and depth < 8 and any(
            saves(u, reader, depth + 1) for u in users.get(reader, []))

    last_reader: dict[str, int] = {}
    for producer, _, consumer, _ in table.edges():
        p, c = position.get(producer), position.get(consumer)
        if p is not None and c is not None and c > p and \
                any(info.is_float for info in table.nodes[producer].outputs):
            last_reader[producer] = max(last_reader.get(producer, 0), c)
    saved_copy_edges = {edge for edge in table.edges() if saves(edge[2], edge[0])}
    return Timeline(order, position, grad_position, saved_copy_edges, last_reader)


def conversion_bytes(full_bytes: float, src_shards: np.ndarray, dst_shards: np.ndarray,
                     is_state: bool, saved: bool):
    """Memory of converting a tensor of ``full_bytes`` between specs with the given
    shard counts (arrays broadcast against each other; equal specs must be masked
    by the caller): (forward transient, backward transient while the consumer's
    kernels run, backward transient after them, kept for the backward). A gather
    makes the gathered copy and gloo's staging copy of it, a split its shard, an
    all-to-all its send buffer and result; the gradient goes back the dual way
    once the consumer's backward has run (a split's gradient is gathered, with
    staging). A parameter's converted copy gets its gradient from the consumer's
    kernels: it lives in both phases (a gathered one's reduction:
    ``_gathered_gradient_bytes``, which ``edge_memory`` puts in its place)."""
    src = full_bytes / src_shards
    dst = full_bytes / dst_shards
    gather, split = src_shards > dst_shards, src_shards < dst_shards
    fwd = np.where(gather, 2 * dst, np.where(split, dst, src + dst))
    after = np.where(gather, src, np.where(split, 2 * src, src + dst))
    during = dst * np.ones_like(after) if is_state else np.zeros_like(after)
    if is_state:
        after = after + dst
    kept = dst if saved else np.zeros_like(dst)
    return fwd, during, after, kept


def edge_memory(table, line: Timeline, edge, src_specs, dst_specs, shard_count):
    """``conversion_bytes`` of ``edge`` for every pair of the given producer and
    consumer specs (matrices, zero where the specs are equal, except that a user
    input read as its placeholder holds it is not kept twice:
    ``input_view_saved_bytes``)."""
    producer, o, consumer, k = edge
    info = table.nodes[producer].outputs[o]
    a = np.array([float(shard_count(x)) for x in src_specs])[:, None]
    b = np.array([float(shard_count(x)) for x in dst_specs])[None, :]
    same = np.array(src_specs, dtype=object)[:, None] == np.array(dst_specs, dtype=object)[None, :]
    is_state = table.nodes[producer].kind in ("parameter", "buffer", "constant")
    fwd, during, after, kept = conversion_bytes(float(info.nbytes), a, b, is_state,
                                                edge in line.saved_copy_edges)
    zero = np.where(same, 0.0, 1.0)
    kept = kept * zero
    if is_state:
        after = after + 0.0 * zero  # one entry per pair
        for i, src in enumerate(src_specs):
            for j, dst in enumerate(dst_specs):
                if a[i, 0] > b[0, j]:
                    after[i, j] = _gathered_gradient_bytes(
                        info.nbytes / b[0, j], info.nbytes / a[i, 0], src, dst,
                        shard_count.mesh)
    if table.nodes[producer].kind == "input":
        for j, spec in enumerate(dst_specs):
            for i in np.flatnonzero(same[:, j]):
                kept[i, j] = -input_view_saved_bytes(table, edge, spec)
    return fwd * zero, during * zero, after * zero, kept


def _gathered_gradient_bytes(dst_bytes: float, src_bytes: float, src: str, dst: str,
                             mesh) -> float:
    """The backward of a gathered parameter copy after the consumer's kernels:
    its gradient (``dst_bytes``) and the stacked copy a reduce-scatter sends
    (``collectives._flat_reduce_scatter``); where several axes were gathered,
    the first step's result beside that copy (the least axis first bounds it)
    instead of the last step's, the shard (``src_bytes``), which the model
    counts as the parameter's gradient from the consumer's kernels on. (A
    forced FSDP MLP on (2,2): 648 KiB where the gather's dual, a split,
    counted 320.) A gradient all-reduced in the graph and then split needs
    as much: the all-reduce's copy, then the split's shard."""
    a, b = ShardingSpec.parse(src), ShardingSpec.parse(dst)
    gathered = {x for d in a.dims for x in d} - {x for d in b.dims for x in d}
    if len(gathered) < 2:
        return 2 * dst_bytes
    first = min(mesh.shape[x] for x in gathered)
    return 2 * dst_bytes + max(0.0, dst_bytes / first - src_bytes)


def input_view_saved_bytes(table, edge, spec: str) -> float:
    """What ``edge``'s consumer counts as saved of a user input it reads in the
    spec the input's placeholder has (``spec``), where the program saves no new
    tensor: every rank is handed the whole input (counted as inputs), and its
    placeholder's block of it (``generate.ops.take_shard``) is the input itself,
    or a view where only the leading dim of size > 1 is split. (The trust MLP's
    tensor-parallel plan: its replicated 2 MiB input counted twice.)"""
    producer, o, consumer, k = edge
    node = table.nodes[consumer]
    if node.saved_input_bytes is None or k >= node.saved_input_bytes.shape[1]:
        return 0.0
    shape = table.nodes[producer].outputs[o].shape
    sharded = [d for d, axes in enumerate(ShardingSpec.parse(spec).dims) if axes]
    if sharded and (len(sharded) > 1 or any(shape[d] != 1 for d in range(sharded[0]))):
        return 0.0  # take_shard copies a block that is not contiguous
    # The strategies saving it there all count the same local bytes.
    saved = [float(node.saved_input_bytes[c, k]) for c, ins in enumerate(node.in_specs)
             if k < len(ins) and ins[k] == spec]
    return max(saved, default=0.0)


@dataclass
class MemoryEstimate:
    """The modelled memory of a step: its peak, where it is (``at``), and the
    bytes live there by category."""

    peak_bytes: float
    at: str
    breakdown: dict[str, float]
    optimizer_step_bytes: float = 0.0
    #: Per position (``Timeline.order``): live bytes while the node's forward
    #: and its backward run.
    forward_bytes: np.ndarray | None = None
    backward_bytes: np.ndarray | None = None


@dataclass
class PlanMemory:
    """The terms of the model for one choice: the bytes held the whole step, and
    per position (``Timeline.order``) what the node keeps for the backward, what
    its forward and backward need while they run (the backward's kernels with
    the node's saved tensors, ``bwd``, then without them, ``after``), and the
    gradients (parameter gradients, bucket copies) its backward adds;
    ``param_shard_bytes`` (each trained parameter's local shard, in the
    optimizer's order) size the optimizer's temporaries."""

    state_bytes: float
    input_bytes: float
    saved: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    after: np.ndarray
    grads: np.ndarray
    buckets: np.ndarray
    param_shard_bytes: list[float]
    #: Waiting output gradients as differences over positions, summed from the
    #: end: ``+bytes`` where they appear, ``-bytes`` before the position that
    #: uses them up.
    waiting: np.ndarray | None = None
    #: Per position, the gradient of the node's own output among the waiting
    #: ones: its backward kernels use it up (freed in the ``after`` phase).
    own_waiting: np.ndarray | None = None


def plan_memory(table, choice: dict[str, int], line: Timeline,
                weight: dict[str, float] | None = None) -> PlanMemory:
    """The model's terms for the strategies ``choice`` picks (``weight``: how often
    each node occurs, for depth-reduced planning)."""
    weight = weight or {}
    n = len(line)
    shard_count = ShardCounts(table.mesh)
    out = PlanMemory(0.0, 0.0, *(np.zeros(n) for _ in range(6)), [], np.zeros(n),
                     np.zeros(n))
    for name, node in table.nodes.items():
        c, w = choice[name], weight.get(name, 1.0)
        out.state_bytes += w * float(node.state_bytes[c])
        out.input_bytes += w * float(node.input_bytes[c])
        if node.kind == "parameter" and node.grad_bytes[c] > 0:
            out.grads[line.grad_position[name]] += w * float(node.grad_bytes[c])
            out.param_shard_bytes.append(float(node.grad_bytes[c]))  # in graph order
        i = line.position.get(name)
        if i is not None and name in line.last_reader:
            g = w * float(waiting_gradient_bytes(node, c, shard_count))
            out.waiting[line.last_reader[name] - 1] += g
            out.own_waiting[i] = g
            if i > 0:
                out.waiting[i - 1] -= g
        if i is not None:
            out.saved[i] = w * float(node.saved_bytes[c])
            out.buckets[i] = w * float(node.bucket_bytes[c])
            out.fwd[i] = float(node.fwd_transient_bytes[c])
            out.bwd[i] = float(node.bwd_transient_bytes[c])
            out.after[i] = float(node.bwd_after_bytes[c])
    for edge in table.edges():
        producer, o, consumer, k = edge
        i = line.position.get(consumer)
        if i is None:
            continue
        src = table.nodes[producer].out_specs[choice[producer]][o]
        dst = table.nodes[consumer].in_specs[choice[consumer]][k]
        if src == dst and table.nodes[producer].kind != "input":
            continue
        f, during, after, kept = (float(m[0, 0]) for m in
                                  edge_memory(table, line, edge, [src], [dst], shard_count))
        out.fwd[i] += f
        out.bwd[i] += during
        out.after[i] += after
        out.saved[i] += weight.get(consumer, 1.0) * kept
        if src == dst:
            continue
        out.buckets[i] += weight.get(consumer, 1.0) * converted_parameter_bucket_bytes(
            table, edge, src, dst, choice[consumer], shard_count)
    _bucket_as_the_program_does(table, choice, line, weight, shard_count, out.buckets)
    return out


def _bucket_as_the_program_does(table, choice, line: Timeline, weight, shard_count,
                                buckets: np.ndarray) -> None:
    """``buckets`` (per position) with the deferred data-parallel gradients
    moved from each reader's backward to where the program copies them: a
    bucket's flat copy is made once its last gradient is ready and lives to the
    end of the backward (``generate/grad_sync.py``), one copy of each gradient
    however many nodes read the parameter. Counted per reader, GPT-2's tied
    embedding and LM head held two copies of its 2 MiB gradient from the LM
    head's backward on, 2 MiB over the step inside every layer's backward
    (the rotor chain's stages with it). The ILP's rows keep the per-reader
    count, an upper bound."""
    deferred = deferred_gradients(table, choice)
    if not deferred:
        return
    for producer, o, consumer, k in table.edges():
        node, i = table.nodes[consumer], line.position.get(consumer)
        made = table.nodes[producer]
        if i is None or made.kind != "parameter" or (made.tied_to or producer) not in deferred \
                or node.reductions is None:
            continue
        c = choice[consumer]
        grads = node.reductions[c][2]
        if k < len(grads) and grads[k]:  # what ``NodeOptions.bucket_bytes`` counts
            buckets[i] -= weight.get(consumer, 1.0) * made.outputs[o].nbytes / shard_count(
                node.in_specs[c][k])
    found, first_use = gradient_buckets(table, choice, weight, deferred=deferred)
    for bucket in found:
        ready = min(line.position.get(first_use[p], 0) for p in bucket.params)
        buckets[ready] += bucket.nbytes


def converted_parameter_bucket_bytes(table, edge, src: str, dst: str, strategy: int,
                                     shard_count) -> float:
    """What the program's gradient buckets hold for a parameter read converted
    (``src != dst``) less what the consumer's strategy counts (a bucket copy of
    its local input, ``NodeOptions.bucket_bytes``): only parameters read as
    stored are bucketed. A fused gather (``automap.solve.fsdp``) reduce-scatters
    the gradient in the graph and buckets the stored shard for the gradient axes
    it does not gather; any other conversion's gradient is reduced in the graph.
    (Forced FSDP MLP on (4,): 1 MiB per layer counted to the end of the
    backward that the program never holds, 14 % of a checkpointed plan's
    peak.) Not in the ILP's rows, which keep the larger count: an upper bound."""
    producer, o, consumer, k = edge
    source, node = table.nodes[producer], table.nodes[consumer]
    # A tied placeholder (GPT-2's LM head reading the embedding) holds no
    # gradient of its own; its reads are bucketed, or not, as the canonical's.
    trained = table.nodes[source.tied_to] if source.tied_to is not None else source
    if source.kind != "parameter" or not trained.grad_bytes.any() or node.reductions is None:
        return 0.0
    grads = node.reductions[strategy][2]
    axes = tuple(grads[k]) if k < len(grads) else ()
    if not axes:
        return 0.0
    info = source.outputs[o]
    counted = info.nbytes / shard_count(dst)
    path = fused_gather(table.mesh, src, dst, list(info.shape), info.dtype_bytes, axes)
    if path is None:
        return -counted
    gathered = {step.axis for step in path.steps}
    rest = [a for a in axes if a not in gathered]
    return (info.nbytes / shard_count(src) if rest else 0.0) - counted


def waiting_gradient_bytes(node, strategy, shard_count) -> float:
    """Local bytes of the gradient of ``node``'s float outputs under ``strategy``."""
    return sum(info.nbytes / shard_count(spec)
               for info, spec in zip(node.outputs, node.out_specs[strategy]) if info.is_float)


def least_held_bytes(table, weight: dict[str, float] | None = None, index=None,
                     gradients: bool = False) -> float:
    """The least bytes any plan of ``table`` holds per device all step: each
    node's state and inputs at its leanest strategy (``index``: per node, the
    strategies considered; default all); with ``gradients``, each parameter's
    gradient too, which every plan holds at the optimizer step (no checkpoint
    frees either)."""
    weight = weight or {}
    total = 0.0
    for name, node in table.nodes.items():
        held = node.state_bytes + node.input_bytes
        if gradients:
            held = held + node.grad_bytes
        if index is not None:
            held = held[index[name]]
        if len(held):
            total += float(np.min(held)) * weight.get(name, 1.0)
    return total


def estimate_memory(table, choice: dict[str, int], line: Timeline, optimizer="adamw",
                    weight: dict[str, float] | None = None) -> MemoryEstimate:
    """The memory of the module docstring for the strategies ``choice`` picks;
    ``weight``: how often each node occurs (depth-reduced planning)."""
    m = plan_memory(table, choice, line, weight)
    n = len(line)
    state, inputs = m.state_bytes, m.input_bytes
    grads_total = float(m.grads.sum())
    base = state + inputs
    kept = np.cumsum(m.saved)
    later_grads = np.cumsum(m.grads[::-1])[::-1]
    later_buckets = np.cumsum(m.buckets[::-1])[::-1]
    waiting = np.cumsum(m.waiting[::-1])[::-1]
    # A node's backward peaks while its kernels run, or after them (its input
    # gradients reduced, converted back), when autograd has freed what it saved.
    during = kept + waiting + m.bwd
    after = kept - m.saved + waiting - m.own_waiting + m.after
    in_kernels = during >= after
    backward = base + later_grads + later_buckets + np.maximum(during, after)
    forward = base + (kept - m.saved) + m.fwd
    opt_temp = optimizer_temp_bytes(optimizer, table.optimizer_impl, m.param_shard_bytes,
                                    grads_total)
    candidates = [(base + grads_total + opt_temp, "optimizer step", -1, "opt")]
    if n:
        i, j = int(np.argmax(backward)), int(np.argmax(forward))
        candidates += [(float(backward[i]), f"backward of {line.order[i]}", i, "bwd"),
                       (float(forward[j]), f"forward of {line.order[j]}", j, "fwd")]
    peak, at, i, phase = max(candidates, key=lambda c: c[0])
    cats = dict.fromkeys(CATEGORIES, 0.0)
    cats["parameters and optimizer state"], cats["inputs"] = state, inputs
    if phase == "opt":
        cats["gradients"], cats["temporaries"] = grads_total, opt_temp
    elif phase == "bwd":
        kernels = bool(in_kernels[i])
        cats.update({"activations": float(kept[i] - (0.0 if kernels else m.saved[i])),
                     "gradients": float(later_grads[i]),
                     "activation gradients": float(waiting[i] - (0.0 if kernels
                                                                 else m.own_waiting[i])),
                     "gradient buckets": float(later_buckets[i]),
                     "temporaries": float(m.bwd[i] if kernels else m.after[i])})
    else:
        cats.update({"activations": float(kept[i] - m.saved[i]), "temporaries": float(m.fwd[i])})
    return MemoryEstimate(float(peak), at, cats, float(candidates[0][0]), forward, backward)
