"""The strategy table of a traced graph: for every node, its valid sharding
strategies on a mesh with their costs in seconds and memory in bytes, and
for every edge the distinct specs on each side. Enumeration and pricing run
in the native core; this module only gathers the per-node facts."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import fx

from automap import _core
from automap.cluster.device import DeviceProfile, resolve_device_profile
from automap.errors import AutomapError, UnsupportedOpError
from automap.sharding.layout import layout_path
from automap.sharding.spec import ShardingSpec, enumerate_specs
from automap.solve.local_scratch import local_scratch_bytes
from automap.solve.signatures import (
    VIEWS_OF_BASE,
    Signature,
    TensorRef,
    op_family,
    signature,
    written_args,
)
from automap.trace.causal_mask import CAUSAL_MASK

#: Optimizer state per parameter byte (fp32 state for fp32 parameters).
OPTIMIZER_STATE_FACTOR = {"sgd": 0, "sgd_momentum": 1, "momentum": 1, "adam": 2, "adamw": 2}

#: The optimizer step per parameter tensor, as torch runs it one tensor at a
#: time: (bytes read and written per byte of the parameter, kernels). SGD:
#: ``p.add_(g)``; with momentum ``buf.mul_().add_(g)``, ``p.add_(buf)``; Adam:
#: ``step += 1``, ``m.lerp_(g)``, ``v.mul_().addcmul_(g, g)``,
#: ``(v.sqrt() / c).add_(eps)`` and ``p.addcdiv_(m, denom)``; AdamW also
#: ``p.mul_(1 - lr * wd)``.
OPTIMIZER_STEP = {"sgd": (3, 1), "sgd_momentum": (8, 3), "momentum": (8, 3), "adam": (18, 8),
                  "adamw": (20, 9)}


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    dtype_bytes: int
    is_float: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype_bytes


#: The per-strategy arrays of a ``NodeOptions`` (index-aligned with its specs).
PER_STRATEGY = ("compute_s", "forward_comm_s", "backward_comm_s", "state_bytes", "grad_bytes",
                "input_bytes", "saved_bytes", "fwd_transient_bytes", "bwd_transient_bytes",
                "bwd_after_bytes", "bucket_bytes")


@dataclass
class NodeOptions:
    """The strategies of one node, index-aligned arrays."""

    name: str
    op: str
    kind: str  # "parameter", "buffer", "input", "einsum", "view", "source", "replicate", "output"
    inputs: list[TensorRef]
    outputs: list[TensorInfo]
    in_specs: list[tuple[str, ...]]
    out_specs: list[tuple[str, ...]]
    compute_s: np.ndarray
    forward_comm_s: np.ndarray
    backward_comm_s: np.ndarray
    # Per-device bytes per strategy (see ``automap.solve.memory`` for when each
    # is live): parameter shards with their optimizer state, buffers and
    # constants (the whole step); the parameter's gradient (from the backward of
    # its last use to the optimizer step); the user input (the whole step);
    # activations kept for the backward (from this node's forward to its
    # backward); temporaries while the node's forward and backward run
    # (outputs, kernel scratch, collective buffers), the backward's in two
    # phases: its kernels (with the node's saved tensors) and after them
    # (``bwd_after_bytes``: the input gradients and their reductions, once
    # autograd has freed what the node saved); data-parallel gradient
    # bucket copies this node's backward adds (to the end of the backward).
    state_bytes: np.ndarray
    grad_bytes: np.ndarray
    input_bytes: np.ndarray
    saved_bytes: np.ndarray
    fwd_transient_bytes: np.ndarray
    bwd_transient_bytes: np.ndarray
    bwd_after_bytes: np.ndarray
    bucket_bytes: np.ndarray
    module_path: str = ""
    tied_to: str | None = None  # a tied parameter placeholder follows this one
    # Input nodes this node saves for its backward that no saved-bytes column
    # counts at its spec (parameters, buffers, activations an earlier node saves
    # too): a conversion of one makes a copy the backward keeps.
    saved_copy_inputs: frozenset[str] = frozenset()
    # Per strategy and input: the bytes of that input the node saves (part of
    # ``saved_bytes``; None: all zero).
    saved_input_bytes: np.ndarray | None = None
    # Per strategy: (partial axes, scatter dim or None, gradient-reduction axes
    # per input), the collectives the node itself runs; None: no collective.
    reductions: list | None = None
    # Per strategy of a parameter: the optimizer step on its shard; None: zeros.
    optimizer_s: np.ndarray | None = None
    # Inputs (by index) the op writes in place: they must arrive as produced, or
    # the write would go to a converted copy and be lost.
    written_inputs: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.in_specs)

    @property
    def time_s(self) -> np.ndarray:
        time = self.compute_s + self.forward_comm_s + self.backward_comm_s
        return time if self.optimizer_s is None else time + self.optimizer_s


@dataclass
class StrategyTable:
    mesh: object
    nodes: dict[str, NodeOptions]
    unsupported_ops: dict[str, list[str]] = field(default_factory=dict)  # op -> node names
    optimizer: str = "adamw"
    #: The kernels of the optimizer's step (``OPTIMIZER_IMPLS``, resolved: not
    #: "auto"), which size its temporaries (``solve.memory.optimizer_temporaries``).
    optimizer_impl: str = "for-loop"
    #: Bytes per element of the bucketed gradient all-reduce under mixed
    #: precision (its ``reduce_dtype``); None: each gradient's own dtype.
    gradient_reduce_bytes: int | None = None

    def edges(self):
        """(producer, output index, consumer, input index) of every tensor edge."""
        for node in self.nodes.values():
            for k, (producer, o) in enumerate(node.inputs):
                yield producer, o, node.name, k

    def conversions(self, choice: dict[str, int]):
        """(edge, tensor info, destination spec, ``LayoutPath``) of every edge
        whose two sides disagree under ``choice`` (strategy index per node)."""
        for producer, o, consumer, k in self.edges():
            src = self.nodes[producer].out_specs[choice[producer]][o]
            dst = self.nodes[consumer].in_specs[choice[consumer]][k]
            if src != dst:
                info = self.nodes[producer].outputs[o]
                path = layout_path(self.mesh, src, dst, info.shape, info.dtype_bytes)
                yield (producer, o, consumer, k), info, dst, path


def _tensor_infos(val) -> list[TensorInfo]:
    leaves = val if isinstance(val, (list, tuple)) else [val]
    return [
        # Complex tensors are differentiable too (their gradients need reducing).
        TensorInfo(tuple(int(s) for s in t.shape), t.dtype.itemsize,
                   t.is_floating_point() or t.is_complex())
        for t in leaves
        if isinstance(t, torch.Tensor)
    ]


class ShardCounts:
    """Shard count of a spec string on the mesh, memoised."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.cache: dict[str, int] = {}

    def __call__(self, spec: str) -> int:
        n = self.cache.get(spec)
        if n is None:
            n = self.cache[spec] = ShardingSpec.parse(spec).shard_count(self.mesh)
        return n


def build_strategy_table(
    traced,
    profile,
    mesh,
    *,
    device: DeviceProfile | None = None,
    flops_per_s: float | None = None,
    memory_bandwidth_bytes_per_s: float | None = None,
    op_overhead_s: float | None = None,
    optimizer: str = "adamw",
    optimizer_impl: str = "for-loop",
    strict: bool = False,
) -> StrategyTable:
    """Strategies of every node of ``traced`` (a ``TracedGraph``) on ``mesh``,
    priced with ``profile`` (a ``Profile`` of the same graph) on ``device``
    (default: the given speeds, the rest measured on this process's device);
    ``optimizer_impl``: its step's kernels (resolved, not "auto")."""
    if device is None:
        device = resolve_device_profile(flops_per_s=flops_per_s,
                                        memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s,
                                        op_overhead_s=op_overhead_s)
    # optimizer None: no state and no step
    opt_factor = OPTIMIZER_STATE_FACTOR[optimizer.lower()] if optimizer else 0
    opt_step = OPTIMIZER_STEP[optimizer.lower()] if optimizer else (0, 0)
    shard_count = ShardCounts(mesh)
    infos: dict[str, list[TensorInfo]] = {}
    needs_grad: dict[str, bool] = {}
    nodes: dict[str, NodeOptions] = {}
    unsupported: dict[str, list[str]] = {}
    params: set[str] = set()  # trainable parameter placeholders
    memo: dict = {}  # einsum strategies per distinct question (_op_options)
    read: dict[str, list[TensorRef]] = {}  # each op's signature inputs
    graph = traced.graph

    for node in graph.nodes:
        if node.op == "placeholder":
            outs = _tensor_infos(node.meta.get("val"))
            infos[node.name] = outs
            state = traced.state_of(node.name)
            nodes[node.name] = _source_options(node.name, outs, mesh, shard_count, state,
                                               opt_factor, opt_step, device)
            needs_grad[node.name] = bool(state is not None and state.requires_grad)
            if state is not None and state.kind == "parameter" and state.requires_grad:
                params.add(node.name)
        elif node.op == "call_function":
            outs = _tensor_infos(node.meta.get("val"))
            infos[node.name] = outs
            if not outs and not written_args(node):
                continue  # nothing made, nothing written: no layout to choose
            sig = signature(node)
            if sig is None:
                unsupported.setdefault(op_family(node), []).append(node.name)
                sig = Signature("replicate", [(a.name, 0) for a in _tensor_args(node)])
            ins = [infos[p][o] for p, o in sig.inputs]
            grads = [needs_grad.get(p, False) and info.is_float
                     for (p, _), info in zip(sig.inputs, ins)]
            needs_grad[node.name] = any(grads) and any(o.is_float for o in outs)
            prof = profile.by_name.get(node.name) if profile is not None else None
            nodes[node.name] = _op_options(node, sig, ins, outs, grads, prof, mesh, shard_count,
                                           device, params, memo)
            read[node.name] = sig.inputs
            written = {a.name for a in written_args(node)}
            nodes[node.name].written_inputs = frozenset(
                k for k, (p, _) in enumerate(sig.inputs) if p in written)
        elif node.op == "output":
            refs = []
            for a in _flatten(node.args[0]):
                if hasattr(a, "name") and a.name in infos and infos[a.name]:
                    refs.append((a.name, 0))
            ins = [infos[p][o] for p, o in refs]
            replicated = tuple("R" * len(i.shape) for i in ins)
            nodes[node.name] = _fixed_options(node.name, "output", "output", refs, [],
                                              [replicated], [()])

    _mark_written_views(graph, nodes, read)
    if unsupported:
        listing = ", ".join(f"{op} ({len(names)}x)" for op, names in sorted(unsupported.items()))
        message = f"no sharding generator for: {listing}; these nodes run replicated"
        if strict:
            raise UnsupportedOpError(message, sorted(unsupported))
        warnings.warn(message, stacklevel=2)
    for name, node in nodes.items():
        state = traced.state_of(name)
        if state is not None and state.tied and state.canonical != state.name:
            canonical = traced.parameters.get(state.canonical) or traced.buffers.get(
                state.canonical)
            if canonical is not None:
                node.tied_to = canonical.node
                node.state_bytes = np.zeros(len(node))
                node.grad_bytes = np.zeros(len(node))
                node.optimizer_s = None
    setting = getattr(traced, "mixed_precision", None)
    return StrategyTable(mesh, nodes, unsupported,
                         optimizer if isinstance(optimizer, str) else "adamw", optimizer_impl,
                         None if setting is None else setting.reduce_dtype.itemsize)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


def _tensor_args(node):
    return [a for a in _flatten(list(node.args) + list(node.kwargs.values()))
            if hasattr(a, "meta") and isinstance(a.meta.get("val"), torch.Tensor)]


def _fixed_options(name, op, kind, inputs, outputs, in_specs, out_specs) -> NodeOptions:
    n = len(in_specs)
    return NodeOptions(name, op, kind, inputs, outputs, in_specs, out_specs,
                       *(np.zeros(n) for _ in PER_STRATEGY))


def _mark_written_views(graph, nodes: dict[str, NodeOptions],
                        read: dict[str, list[TensorRef]]) -> None:
    """A write into a view writes into its base (``shifted[:, 1:] = ids[:, :-1]``
    copies into a slice of ``new_zeros``): every view on the way must read its
    base as produced, as the written input itself must arrive, or the write goes
    to a converted copy. (Only the written input was held so before: the
    least-memory plan of T5 on (2,) converted the base of such a slice, and the
    generator refused it.)"""
    for node in graph.nodes:
        for view in written_args(node):
            while (view.op == "call_function" and op_family(view) in VIEWS_OF_BASE
                   and view.name in nodes and view.args and isinstance(view.args[0], fx.Node)):
                base = view.args[0].name
                ks = frozenset(k for k, (p, _) in enumerate(read.get(view.name, ())) if p == base)
                if not ks:
                    break
                nodes[view.name].written_inputs |= ks
                view = view.args[0]


def _source_options(name, outs, mesh, shard_count, state, opt_factor, opt_step,
                    device: DeviceProfile) -> NodeOptions:
    kind = "input" if state is None else state.kind
    if not outs:
        return _fixed_options(name, "placeholder", kind, [], [], [()], [()])
    info = outs[0]
    specs = [str(s) for s in enumerate_specs(info.shape, mesh)]
    node = _fixed_options(name, "placeholder", kind, [], outs, [() for _ in specs],
                          [(s,) for s in specs])
    local = np.array([info.nbytes / shard_count(s) for s in specs])
    if kind == "parameter":
        node.state_bytes = local * (1 + (opt_factor if state.requires_grad else 0))
        if state.requires_grad:
            node.grad_bytes = local
            passes, kernels = opt_step
            node.optimizer_s = (passes * local / device.memory_bandwidth_bytes_per_s
                                + kernels * device.op_overhead_s)
    elif kind in ("buffer", "constant"):
        node.state_bytes = local
    else:  # a user input: every rank is handed the global batch
        node.input_bytes = np.full(len(specs), float(info.nbytes))
    if state is not None:
        node.module_path = state.module_path
    return node


def _work_s(device: DeviceProfile, flops: float, in_bytes, out_bytes, grads) -> float:
    """The roofline of a node's local work, as the Rust generator prices an
    einsum strategy: the forward reads the inputs and writes the outputs (one
    kernel); with gradients, the backward reads the output gradient and the
    inputs and writes each needed input gradient (a kernel each)."""
    moved = sum(in_bytes) + sum(out_bytes)
    needed = [b for b, g in zip(in_bytes, grads) if g]
    if needed:
        return device.work_s(flops, 2 * moved + sum(needed), 1 + len(needed))
    return device.work_s(flops, moved, 1)


def _is_view(node) -> bool:
    """Whether the op returns a view of an input (no bytes move)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _op_options(node, sig, ins, outs, grads, prof, mesh, shard_count, device: DeviceProfile,
                params, memo: dict):
    flops = float(prof.fwd_flops + prof.bwd_flops) if prof is not None else 0.0
    name, op = node.name, op_family(node)
    reductions = None  # only einsum strategies run collectives of their own
    # A view's kernels: its forward, and its backward when a gradient flows.
    view_s = device.op_overhead_s * (2 if any(grads) else 1)
    if sig.kind == "einsum":
        def strategies(flops: float):
            # A model's repeated blocks ask the same (GPT-2 small: 12 times each,
            # half of the table's build): enumerated once per distinct question.
            key = (tuple(sig.letter_sizes), tuple(sig.unshardable),
                   tuple(map(tuple, sig.input_letters)), tuple(map(tuple, sig.output_letters)),
                   tuple(float(i.nbytes) for i in ins), tuple(float(o.nbytes) for o in outs),
                   tuple(grads), tuple(sig.additive_flags()), flops, _is_view(node))
            found = memo.get(key)
            if found is None:
                in_specs, out_specs, costs, reductions = _core.einsum_strategies(
                    mesh, device.flops_per_s, device.memory_bandwidth_bytes_per_s,
                    device.op_overhead_s, sig.letter_sizes, sig.unshardable,
                    sig.input_letters, sig.output_letters, list(key[4]), list(key[5]),
                    grads, sig.additive_flags(), flops, key[9])
                found = memo[key] = ([tuple(s) for s in in_specs],
                                     [tuple(s) for s in out_specs], costs, reductions)
            return found

        in_specs, out_specs, costs, reductions = strategies(flops)
        costs = np.frombuffer(costs, dtype=np.float64).reshape(-1, 3)
        in_specs = list(in_specs)
        if node.meta.get(CAUSAL_MASK):
            costs = _causal_kernel_costs(node, in_specs, costs, strategies, flops)
        if sig.split_reductions is not None:
            costs = costs + _split_reduction_costs(sig.split_reductions, ins, in_specs, mesh,
                                                   shard_count)
        out_specs = list(out_specs)
        reductions = None if reductions is None else list(reductions)
    elif sig.kind == "view":
        pairs = _core.reshape_strategies(list(ins[0].shape), list(outs[0].shape), mesh)
        in_specs = [(a,) for a, _ in pairs]
        out_specs = [(b,) for _, b in pairs]
        costs = np.zeros((len(pairs), 3))
        costs[:, 0] = view_s
    elif sig.kind == "source":
        specs = [str(s) for s in enumerate_specs(outs[0].shape, mesh)] if len(outs) == 1 else []
        if not specs:
            specs = ["R" * len(outs[0].shape)] if outs else [""]
        in_specs = [() for _ in specs]
        out_specs = [(s,) for s in specs]
        costs = np.zeros((len(specs), 3))
        # A source writes its (local) output.
        written = sum(o.nbytes for o in outs)
        costs[:, 0] = [device.work_s(0.0, written / shard_count(s) if len(outs) == 1 else written,
                                     1) for s in specs]
    else:  # replicated: every device runs the whole op
        in_specs = [tuple("R" * len(i.shape) for i in ins)]
        out_specs = [tuple("R" * len(o.shape) for o in outs)]
        work = _work_s(device, flops, [i.nbytes for i in ins], [o.nbytes for o in outs], grads)
        costs = np.array([[work, 0.0, 0.0]])
    if sig.kind == "einsum" and len(sig.output_letters) != len(outs):
        raise ValueError(f"{name}: signature has {len(sig.output_letters)} outputs, node "
                         f"{len(outs)}")
    options = NodeOptions(
        name, op, sig.kind, list(sig.inputs), outs, in_specs, out_specs,
        costs[:, 0].copy(), costs[:, 1].copy(), costs[:, 2].copy(),
        *(np.zeros(len(in_specs)) for _ in PER_STRATEGY[3:]),
        module_path=prof.module_path if prof is not None else "",
        reductions=reductions,
    )
    if prof is not None:
        _activation_memory(options, ins, outs, prof, mesh, shard_count, params)
        options.saved_copy_inputs = frozenset(prof.saved_state_bytes) | frozenset(
            prof.shared_saved_bytes)
    return options


def _causal_kernel_costs(node, in_specs, costs, strategies, flops: float) -> np.ndarray:
    """Attention with a constant causal mask runs the causal kernel wherever its queries'
    sequence stays whole (``automap.generate.localize.causal_attention``): it computes
    the scores on and below the diagonal, L(L+1)/2 of L*S, not all of them."""
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    length, keys = int(q.shape[-2]), int(k.shape[-2])
    fraction = (length + 1) / (2 * keys)
    causal = np.frombuffer(strategies(flops * fraction)[2], dtype=np.float64).reshape(-1, 3)
    seq_dim = q.dim() - 2
    whole = np.array([not ShardingSpec.parse(specs[0]).dims[seq_dim] for specs in in_specs])
    return np.where(whole[:, None], causal, costs)


def _activation_memory(options: NodeOptions, ins, outs, prof, mesh, shard_count,
                       params: set[str]) -> None:
    """The node's activation memory per strategy, each profiled tensor at the local
    size of the spec it has there: saved inputs at the spec they arrive in, saved
    outputs and temporaries at the output's; the buffers of the node's own
    collectives (the all-reduce's copy, gloo's reduce-scatter staging); input
    gradients reduced in the graph (a copy), or, for parameters read directly,
    in the gradient buckets."""
    n = len(options)
    out_share = np.array([1.0 / shard_count(so[0]) if so else 1.0 for so in options.out_specs])
    in_share = np.array([[1.0 / shard_count(x) for x in si] for si in options.in_specs]) \
        if ins else np.ones((n, 0))
    saved = np.zeros(n)
    per_input = np.zeros((n, len(options.inputs)))
    seen = set()
    for k, (producer, _) in enumerate(options.inputs):
        if producer in prof.saved_input_bytes and producer not in seen:
            seen.add(producer)
            per_input[:, k] = prof.saved_input_bytes[producer] * in_share[:, k]
            saved += per_input[:, k]
    # Saved tensors of inputs the signature does not list scale with the output.
    saved += sum(b for p, b in prof.saved_input_bytes.items() if p not in seen) * out_share
    for j, b in prof.saved_output_bytes.items():
        share = np.array([1.0 / shard_count(so[j]) if j < len(so) else 1.0
                          for so in options.out_specs])
        saved += b * share
    # Temporaries have the shape of the node's largest operand (a loss's
    # log-probabilities, an attention's weights): its share scales them.
    operands = [(i.nbytes, in_share[:, k]) for k, i in enumerate(ins)] + [
        (o.nbytes, np.array([1.0 / shard_count(so[j]) for so in options.out_specs]))
        for j, o in enumerate(outs)]
    largest_share = max(operands, key=lambda t: t[0])[1] if operands else np.ones(n)
    # But for those shaped as a smaller input (attention's float copy of its
    # mask, split by the batch only where q is split by the heads too: ViT on
    # (2,2,2) kept 4x the mask's copy the model counted).
    rest, split_as_input = float(prof.fwd_tmp_bytes), set()
    for k, (producer, _) in enumerate(options.inputs):
        nbytes = prof.fwd_tmp_input_bytes.get(producer, 0)
        if nbytes and producer not in split_as_input:
            split_as_input.add(producer)
            saved += nbytes * in_share[:, k]
            rest -= nbytes
    saved += rest * largest_share
    local_out = np.array([sum(o.nbytes / shard_count(x) for o, x in zip(outs, so))
                          for so in options.out_specs])

    def transient(nbytes: int, kernel) -> np.ndarray:
        # Scaled with the largest operand, but for a kernel whose scratch is not
        # proportional (``local_scratch``), which is asked at the local shapes.
        local = None if kernel is None else local_scratch_bytes(
            kernel, options.in_specs, options.out_specs, options.reductions, ins, outs, mesh.shape)
        if local is None:
            return nbytes * largest_share
        return np.where(np.isnan(local), nbytes * largest_share,
                        max(0, nbytes - kernel.nbytes) * largest_share + local)

    fwd = transient(prof.fwd_buffer_bytes, prof.fwd_scratch) + prof.fwd_out_bytes * out_share
    param_grads = sum(i.nbytes for (p, _), i in zip(options.inputs, ins) if p in params)
    # Input gradients have the inputs' shapes.
    act = [k for k, (p, _) in enumerate(options.inputs) if p not in params]
    act_full = sum(ins[k].nbytes for k in act)
    act_share = (sum(ins[k].nbytes * in_share[:, k] for k in act) / act_full if act_full
                 else largest_share)
    bwd = (transient(prof.bwd_tmp_bytes, prof.bwd_scratch)
           + max(0.0, prof.bwd_out_bytes - param_grads) * act_share)
    # A node's own collectives run before (gathering a scattered output's
    # gradient) or after (reducing a partial output, or an input gradient) its
    # kernels, whose scratch is freed by then: each phase is its own peak.
    fwd_reduce, bwd_gather = np.zeros(n), np.zeros(n)
    bwd_reduce = max(0.0, prof.bwd_out_bytes - param_grads) * act_share
    buckets = np.zeros(n)
    if options.reductions is not None:
        for s, (partial, scatter, grad_axes) in enumerate(options.reductions):
            if partial:
                # The op makes its partial output whole-sized along the scatter
                # dim; the all-reduce works on a copy of it, the reduce-scatter
                # on a stacked copy (summed in place on gloo), and its backward
                # gathers the gradient (with a staging copy), which its kernels
                # then read.
                if scatter is None:
                    fwd_reduce[s] = 2 * local_out[s]
                else:
                    group = math.prod(mesh.shape[a] for a in partial)
                    raw = local_out[s] * group
                    fwd[s] += raw - prof.fwd_out_bytes * out_share[s]
                    fwd_reduce[s] = 2 * raw + local_out[s]
                    bwd_gather[s] = 2 * raw
                    # The gathered gradient replaces the node's own output
                    # gradient (counted waiting), which autograd frees once the
                    # gather has read it: before the kernels run.
                    bwd[s] += raw - local_out[s]
            for k, axes in enumerate(grad_axes):
                if not axes:
                    continue
                local_in = ins[k].nbytes * in_share[s, k]
                if options.inputs[k][0] in params:
                    buckets[s] += local_in
                else:
                    bwd_reduce[s] += local_in
    options.saved_bytes = saved
    options.saved_input_bytes = per_input if per_input.any() else None
    options.fwd_transient_bytes = np.maximum(fwd, fwd_reduce)
    options.bwd_transient_bytes = np.maximum(bwd, bwd_gather)
    options.bwd_after_bytes = bwd_reduce
    options.bucket_bytes = buckets


def _split_reduction_costs(split, ins, in_specs, mesh, shard_count) -> np.ndarray:
    """Per strategy, (0, forward, backward) seconds of the all-reduces a split
    of ``split``'s dim adds (``Signature.split_reductions``): each of a tensor
    with the input's other dims, local, over the axes splitting that dim."""
    index, dim, forward, backward = split
    info = ins[index]
    out = np.zeros((len(in_specs), 3))
    for i, specs in enumerate(in_specs):
        axes = list(ShardingSpec.parse(specs[index]).dims[dim])
        if axes:
            along = math.prod(mesh.shape[a] for a in axes)
            local = info.nbytes / info.shape[dim] / (shard_count(specs[index]) / along)
            cost = mesh.all_reduce_cost_s(local, axes)
            out[i, 1:] = forward * cost, backward * cost
    return out


def parameters_whole(table: StrategyTable, node: NodeOptions):
    """Data parallelism's constraint on a node, a ``keep`` for ``restrict``: every
    parameter whole on every device (other nodes keep all their strategies)."""
    if node.kind != "parameter":
        return np.ones(len(node), dtype=bool)
    return np.array([all(ShardingSpec.parse(spec).is_replicated for spec in outs)
                     for outs in node.out_specs])


def restricted(table: StrategyTable, keep) -> StrategyTable | None:
    """A copy of ``table`` restricted as ``restrict`` does (``table`` untouched: the
    nodes it restricts are copied), or None when ``keep`` removes nothing or
    leaves some node no strategy (no plan of that family exists)."""
    masks = {name: np.asarray(keep(table, node), dtype=bool)
             for name, node in table.nodes.items()}
    changed = {name: mask for name, mask in masks.items() if not mask.all()}
    if not changed or not all(mask.any() for mask in changed.values()):
        return None
    out = replace(table, nodes=dict(table.nodes))
    for name, mask in changed.items():
        out.nodes[name] = replace(table.nodes[name])
        _keep_only(out.nodes[name], mask)
    return out


def restrict(table: StrategyTable, keep) -> None:
    """Drop the strategies ``keep(table, node)`` (a bool per strategy) rejects,
    e.g. to price a hand-made plan family under the same cost model."""
    for node in table.nodes.values():
        mask = np.asarray(keep(table, node), dtype=bool)
        if not mask.any():
            raise AutomapError(f"no strategy of node {node.name} ({node.op}) satisfies the "
                               f"strategy filter")
        if not mask.all():
            _keep_only(node, mask)


def _keep_only(node: NodeOptions, mask: np.ndarray) -> None:
    """Drop ``node``'s strategies where ``mask`` is False (its per-strategy
    lists and arrays replaced, not edited: a shallow copy keeps the original's)."""
    idx = np.flatnonzero(mask)
    node.in_specs = [node.in_specs[i] for i in idx]
    node.out_specs = [node.out_specs[i] for i in idx]
    if node.reductions is not None:
        node.reductions = [node.reductions[i] for i in idx]
    if node.saved_input_bytes is not None:
        node.saved_input_bytes = node.saved_input_bytes[idx]
    if node.optimizer_s is not None:
        node.optimizer_s = node.optimizer_s[idx]
    for attr in PER_STRATEGY:
        setattr(node, attr, getattr(node, attr)[idx])
