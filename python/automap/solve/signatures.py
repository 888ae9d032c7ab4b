"""The signature of every traced aten op: how its dims relate, in the letter
form the native strategy generator takes (see rust/strategy/einsum.rs).

Each dim of each operand gets a letter; equal letters are one index. A
letter absent from the output is contracted (sharding it leaves a partial
sum); letters marked unshardable stay whole (softmax dims, conv windows,
size-1 broadcast dims, dims that slicing or concatenation changes). Views
that merge or split dims are a separate kind; tensors made from nothing
(``arange``, ``new_ones``) are sources. An op without an entry here runs
replicated (listed by the planner; an error under ``strict=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from automap.trace import functions

#: A tensor a node reads: (producer node name, index of the producer's output).
TensorRef = tuple[str, int]


@dataclass
class Signature:
    kind: str  # "einsum", "view", "source" or "replicate"
    inputs: list[TensorRef] = field(default_factory=list)
    letter_sizes: list[int] = field(default_factory=list)
    unshardable: list[bool] = field(default_factory=list)
    input_letters: list[list[int]] = field(default_factory=list)
    output_letters: list[list[int]] = field(default_factory=list)
    # Inputs added to a contraction's result (biases): see rust/strategy/einsum.rs.
    additive: list[bool] = field(default_factory=list)
    # A dim whose split makes the node all-reduce values of its other dims
    # besides what the letters say (the partial max and sums of a class-parallel
    # softmax or loss, generate/localize.py): (input, dim, forward all-reduces,
    # backward all-reduces), priced by solve/strategies.py.
    split_reductions: tuple[int, int, int, int] | None = None

    def additive_flags(self) -> list[bool]:
        return self.additive or [False] * len(self.inputs)


class _Letters:
    """Allocates letters for one node."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.fixed: list[bool] = []

    def new(self, size: int, shardable: bool = True) -> int:
        self.sizes.append(int(size))
        self.fixed.append(not shardable or size == 1)
        return len(self.sizes) - 1

    def fix(self, *letters: int) -> None:
        for letter in letters:
            self.fixed[letter] = True

    def dims(self, shape) -> list[int]:
        return [self.new(s) for s in shape]


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _is_tensor(x) -> bool:
    return isinstance(_val(x), torch.Tensor)


def _shape(x) -> list[int]:
    return [int(s) for s in _val(x).shape]


def _ref(x: fx.Node) -> TensorRef:
    return (x.name, 0)


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _broadcast_letters(L: _Letters, out: list[int], shape: list[int]) -> list[int]:
    """Letters of an input broadcast (aligned right) against output letters."""
    letters = []
    offset = len(out) - len(shape)
    for j, size in enumerate(shape):
        o = out[offset + j]
        letters.append(o if size == L.sizes[o] else L.new(size, shardable=False))
    return letters


def _einsum(L: _Letters, inputs: list[fx.Node], in_letters, out_letters) -> Signature:
    return Signature(
        "einsum",
        [_ref(x) for x in inputs],
        L.sizes,
        L.fixed,
        [list(x) for x in in_letters],
        [list(x) for x in out_letters],
    )


# Families -----------------------------------------------------------------------------


def _elementwise(node: fx.Node, fixed_dims=()) -> Signature:
    """Pointwise ops with broadcasting; ``fixed_dims`` of the output stay whole."""
    L = _Letters()
    out = L.dims(_shape(node))
    L.fix(*(out[_norm_dim(d, len(out))] for d in fixed_dims))
    tensors = [a for a in _flat_args(node) if _is_tensor(a)]
    ins = [_broadcast_letters(L, out, _shape(t)) for t in tensors]
    return _einsum(L, tensors, ins, [out])


def _flat_args(node: fx.Node) -> list:
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


def _linear(node: fx.Node) -> Signature:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 and _is_tensor(node.args[2]) else None
    L = _Letters()
    xs = _shape(x)
    batch = L.dims(xs[:-1])
    k = L.new(xs[-1])
    n = L.new(_shape(w)[0])
    ins, tensors = [batch + [k], [n, k]], [x, w]
    if b is not None:
        tensors.append(b)
        ins.append(_broadcast_letters(L, batch + [n], _shape(b)))
    sig = _einsum(L, tensors, ins, [batch + [n]])
    sig.additive = [False, False] + ([True] if b is not None else [])
    return sig


def _matmul_like(node: fx.Node, a: fx.Node, b: fx.Node, bias: fx.Node | None) -> Signature:
    """a[..., i, k] @ b[..., k, j] with broadcast batch dims (mm, bmm, matmul, addmm)."""
    sa, sb, so = _shape(a), _shape(b), _shape(node)
    if len(sa) < 2 or len(sb) < 2:
        return Signature("replicate", [_ref(t) for t in (a, b, bias) if t is not None])
    L = _Letters()
    out = L.dims(so)
    k = L.new(sa[-1])
    batch = out[:-2]
    la = _broadcast_letters(L, batch, sa[:-2]) + [out[-2], k]
    lb = _broadcast_letters(L, batch, sb[:-2]) + [k, out[-1]]
    tensors, ins = [a, b], [la, lb]
    if bias is not None:
        tensors.insert(0, bias)
        ins.insert(0, _broadcast_letters(L, out, _shape(bias)))
    sig = _einsum(L, tensors, ins, [out])
    sig.additive = ([True] if bias is not None else []) + [False, False]
    return sig


def _reduction(node: fx.Node, linear: bool) -> Signature:
    x = node.args[0]
    xs = _shape(x)
    dims = node.args[1] if len(node.args) > 1 else None
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    if dims is None or dims == []:
        reduced = set(range(len(xs)))
    else:
        dims = [dims] if isinstance(dims, int) else dims
        reduced = {_norm_dim(d, len(xs)) for d in dims}
    L = _Letters()
    ins = L.dims(xs)
    if not linear:
        L.fix(*(ins[d] for d in reduced))
    out = []
    for d, letter in enumerate(ins):
        if d not in reduced:
            out.append(letter)
        elif keepdim:
            out.append(L.new(1, shardable=False))
    return _einsum(L, [x], [ins], [out])


def _softmax(node: fx.Node) -> Signature:
    """softmax/log_softmax: the normalised dim may be split (a partial max and
    sum over the shards, and the gradient's sum, generate/localize.py)."""
    sig = _elementwise_single(node, fixed=[])
    sig.split_reductions = (0, _norm_dim(node.args[1], _val(node).dim()), 2, 1)
    return sig


def _logsumexp(node: fx.Node) -> Signature:
    """The reduced dims may be split: the letters price the sum's all-reduce,
    the max's comes on top."""
    sig = _reduction(node, linear=True)
    dims = _dim_arg(node, 1, "dim")
    sig.split_reductions = (0, _norm_dim(dims[-1], _val(node.args[0]).dim()), 1, 0)
    return sig


def _elementwise_single(node: fx.Node, fixed) -> Signature:
    x = node.args[0]
    L = _Letters()
    letters = L.dims(_shape(x))
    L.fix(*(letters[_norm_dim(d, len(letters))] for d in fixed))
    return _einsum(L, [x], [letters], [letters])


def _layer_norm(node: fx.Node) -> Signature:
    x, normalized = node.args[0], node.args[1]
    weight = node.args[2] if len(node.args) > 2 and _is_tensor(node.args[2]) else None
    bias = node.args[3] if len(node.args) > 3 and _is_tensor(node.args[3]) else None
    L = _Letters()
    letters = L.dims(_shape(x))
    norm = letters[len(letters) - len(normalized):]
    L.fix(*norm)
    tensors, ins = [x], [letters]
    for t in (weight, bias):
        if t is not None:
            tensors.append(t)
            ins.append(norm)
    return _einsum(L, tensors, ins, [letters])


def _embedding(node: fx.Node) -> Signature:
    weight, ids = node.args[0], node.args[1]
    L = _Letters()
    v, h = L.new(_shape(weight)[0]), L.new(_shape(weight)[1])
    idx = L.dims(_shape(ids))
    # Vocab-parallel: rows outside a shard's range contribute zeros, a partial sum.
    return _einsum(L, [weight, ids], [[v, h], idx], [idx + [h]])


def _conv(node: fx.Node, transposed: bool = False) -> Signature:
    """conv: weight (out, in / groups, *window); conv_transpose (``transposed``):
    weight (in, out / groups, *window). Batch and (without groups) both channel
    dims split; space and window stay whole."""
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 and _is_tensor(node.args[2]) else None
    groups = _arg(node, 6, "groups", 1)
    xs, ws, os_ = _shape(x), _shape(w), _shape(node)
    L = _Letters()
    b, c = L.new(xs[0]), L.new(xs[1], shardable=groups == 1)
    o = L.new(os_[1], shardable=groups == 1)
    spatial_in = [L.new(s, shardable=False) for s in xs[2:]]
    window = [L.new(s, shardable=False) for s in ws[2:]]
    spatial_out = [L.new(s, shardable=False) for s in os_[2:]]
    first, second = (c, o) if transposed else (o, c)
    w_letters = [first, second if groups == 1 else L.new(ws[1], shardable=False)] + window
    tensors, ins = [x, w], [[b, c] + spatial_in, w_letters]
    if bias is not None:
        tensors.append(bias)
        ins.append([o])
    sig = _einsum(L, tensors, ins, [[b, o] + spatial_out])
    sig.additive = [False, False] + ([True] if bias is not None else [])
    return sig


def _batch_norm(node: fx.Node) -> Signature:
    # Statistics over batch and space: only channels split without a sync.
    x = node.args[0]
    L = _Letters()
    letters = L.dims(_shape(x))
    L.fix(*(letters[:1] + letters[2:]))
    tensors, ins = [x], [letters]
    for t in node.args[1:5]:
        if _is_tensor(t):
            tensors.append(t)
            ins.append([letters[1]])
    return _einsum(L, tensors, ins, [letters])


def _sdpa(node: fx.Node) -> Signature:
    """Attention q[..., s, d], k[..., t, d], v[..., t, e]: leading (batch, head)
    dims split; queries too, except under a causal mask tied to absolute
    positions; keys, values and head dims stay whole. Grouped-query attention
    (fewer key/value heads) keeps its heads whole."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    is_causal = _arg(node, 5, "is_causal", False)
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    L = _Letters()
    lead = L.dims(qs[:-2])
    kv_lead = [lq if ks[i] == qs[i] else L.new(ks[i], shardable=False)
               for i, lq in enumerate(lead)]
    L.fix(*(lq for lq, lk in zip(lead, kv_lead) if lq != lk))
    s = L.new(qs[-2], shardable=not is_causal)
    t = L.new(ks[-2], shardable=False)
    d = L.new(qs[-1], shardable=False)
    e = L.new(vs[-1], shardable=False)
    tensors = [q, k, v]
    ins = [lead + [s, d], kv_lead + [t, d], kv_lead + [t, e]]
    if _is_tensor(mask):
        tensors.append(mask)
        ins.append(_broadcast_letters(L, lead + [s, t], _shape(mask)))
    return _einsum(L, tensors, ins, [lead + [s, e]])


def _permute(node: fx.Node, order) -> Signature:
    x = node.args[0]
    L = _Letters()
    letters = L.dims(_shape(x))
    return _einsum(L, [x], [letters], [[letters[d] for d in order]])


def _transpose(node: fx.Node) -> Signature:
    rank = len(_shape(node.args[0]))
    a, b = (_norm_dim(d, rank) for d in node.args[1:3])
    order = list(range(rank))
    order[a], order[b] = order[b], order[a]
    return _permute(node, order)


def _slice(node: fx.Node) -> Signature:
    x = node.args[0]
    xs, os_ = _shape(x), _shape(node)
    L = _Letters()
    ins = L.dims(xs)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(xs))
    out = list(ins)
    if xs[dim] != os_[dim]:
        L.fix(ins[dim])
        out[dim] = L.new(os_[dim], shardable=False)
    return _einsum(L, [x], [ins], [out])


def _select(node: fx.Node) -> Signature:
    x = node.args[0]
    L = _Letters()
    ins = L.dims(_shape(x))
    dim = _norm_dim(node.args[1], len(ins))
    L.fix(ins[dim])
    return _einsum(L, [x], [ins], [ins[:dim] + ins[dim + 1:]])


def _cat(node: fx.Node) -> Signature:
    out_rank = _val(node).dim()
    # Empty inputs of the output's rank (Phi-3's pass-through part of a full
    # rotary) take part like any other; legacy 1-D empties are skipped by cat.
    tensors = [t for t in node.args[0] if _is_tensor(t) and _val(t).dim() == out_rank]
    L = _Letters()
    out = L.dims(_shape(node))
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(out))
    L.fix(out[dim])
    ins = []
    for t in tensors:
        letters = list(out)
        letters[dim] = L.new(_shape(t)[dim], shardable=False)
        ins.append(letters)
    return _einsum(L, tensors, ins, [out])


def _split(node: fx.Node, dim_position: int = 2) -> Signature:
    """split/chunk/unbind: the pieces follow the input's spec on every other dim."""
    x = node.args[0]
    L = _Letters()
    ins = L.dims(_shape(x))
    dim = _norm_dim(_arg(node, dim_position, "dim", 0), len(ins))
    L.fix(ins[dim])
    outs = []
    for piece in _val(node):
        letters = list(ins)
        if piece.dim() == len(ins):
            letters[dim] = L.new(int(piece.shape[dim]), shardable=False)
        else:  # unbind drops the dim
            del letters[dim]
        outs.append(letters)
    return _einsum(L, [x], [ins], outs)


def _arg(node: fx.Node, position: int, name: str, default=None):
    """Argument ``name`` of ``node``, given by position or by keyword."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _getitem(node: fx.Node) -> Signature:
    producer, index = node.args
    L = _Letters()
    letters = L.dims(_shape(node))
    return Signature("einsum", [(producer.name, int(index))], L.sizes, L.fixed, [letters],
                     [letters])


def _cross_entropy(node: fx.Node) -> Signature:
    logits, target = node.args[0], node.args[1]
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    ls = _shape(logits)
    L = _Letters()
    n = L.dims(ls[:1]) if len(ls) > 1 else []
    # Classes split (vocab-parallel, Megatron-LM's layout of the logits): partial
    # max and sum over the shards, generate/localize.py. Not with class weights
    # or label smoothing (nll_loss reads whole rows).
    weighted = len(node.args) > 2 and _is_tensor(node.args[2])
    smoothing = _arg(node, 5, "label_smoothing", 0.0)
    soft = _val(target).is_floating_point()  # class probabilities, the logits' shape
    vocab_parallel = (op_family(node) == "cross_entropy_loss" and not weighted
                      and not smoothing and not soft)
    c = L.new(ls[1] if len(ls) > 1 else ls[0], shardable=vocab_parallel)
    rest = L.dims(ls[2:])
    logit_letters = n + [c] + rest
    target_letters = list(logit_letters) if soft else _broadcast_letters(L, n + rest,
                                                                         _shape(target))
    # Mean and sum reductions are linear: a split batch leaves partial sums.
    out = [] if reduction != 0 else n + rest
    tensors = [logits, target]
    ins = [logit_letters, target_letters]
    if weighted:
        tensors.append(node.args[2])
        ins.append([c])
    sig = _einsum(L, tensors, ins, [out])
    if vocab_parallel:  # the max, the sum and the target's logit, per row
        sig.split_reductions = (0, len(n), 3, 0)
    return sig


def _along(node: fx.Node, whole_dims=(), extra: tuple = ()) -> Signature:
    """An op that works along some dims of its first input (sort, topk, cumsum,
    diff, pad, fft, roll...): those dims and every dim whose size changes stay
    whole; the others keep their split in every output of the input's rank.
    ``extra`` tensors (diff's prepend/append) have the input's dims."""
    x = node.args[0]
    xs = _shape(x)
    L = _Letters()
    ins = L.dims(xs)
    L.fix(*(ins[_norm_dim(d, len(xs))] for d in whole_dims))
    vals = _val(node) if isinstance(_val(node), (list, tuple)) else [_val(node)]
    outs = []
    for val in vals:
        shape = [int(s) for s in val.shape]
        if len(shape) != len(xs):
            raise TypeError(f"{node.name}: output rank differs from the input's")
        letters = []
        for d, size in enumerate(shape):
            if size == xs[d]:
                letters.append(ins[d])
            else:
                L.fix(ins[d])
                letters.append(L.new(size, shardable=False))
        outs.append(letters)
    tensors, in_letters = [x], [ins]
    for t in extra:
        if _is_tensor(t):
            ts = _shape(t)
            tensors.append(t)
            in_letters.append([ins[d] if ts[d] == xs[d] and not L.fixed[ins[d]]
                               else L.new(ts[d], shardable=False) for d in range(len(ts))])
    return _einsum(L, tensors, in_letters, outs)


def _dim_arg(node: fx.Node, position: int, name: str, default=-1) -> list[int]:
    dims = _arg(node, position, name, default)
    if dims is None:
        return list(range(_val(node.args[0]).dim()))
    return [dims] if isinstance(dims, int) else list(dims)


def _repeat(node: fx.Node) -> Signature:
    """repeat: repeated dims stay whole, new leading dims are whole."""
    x, sizes = node.args[0], list(node.args[1])
    xs = _shape(x)
    L = _Letters()
    ins = L.dims(xs)
    lead = len(sizes) - len(xs)
    out = [L.new(int(s), shardable=False) for s in sizes[:lead]]
    for d, r in enumerate(sizes[lead:]):
        if r == 1:
            out.append(ins[d])
        else:
            L.fix(ins[d])
            out.append(L.new(xs[d] * int(r), shardable=False))
    return _einsum(L, [x], [ins], [out])


def _stack(node: fx.Node) -> Signature:
    tensors = [t for t in node.args[0] if _is_tensor(t)]
    L = _Letters()
    out = L.dims(_shape(node))
    dim = _norm_dim(_arg(node, 1, "dim", 0), len(out))
    L.fix(out[dim])
    ins = [out[:dim] + out[dim + 1:] for _ in tensors]
    return _einsum(L, tensors, ins, [out])


def _index(node: fx.Node) -> Signature:
    """x[i0, i1, ...] with index tensors (None: the whole dim): indexed dims of x
    stay whole; the index tensors' dims keep their split (the output's indexed
    part follows them); other dims of x keep theirs."""
    x, indices = node.args[0], list(node.args[1])
    xs = _shape(x)
    if any(i is not None and _val(i).dtype == torch.bool for i in indices):
        raise TypeError("boolean masks give data-dependent shapes")
    picked = [d for d, i in enumerate(indices) if i is not None]
    idx_shape = list(torch.broadcast_shapes(*(tuple(_shape(indices[d])) for d in picked)))
    L = _Letters()
    ins = L.dims(xs)
    L.fix(*(ins[d] for d in picked))
    idx = L.dims(idx_shape)
    kept = [ins[d] for d in range(len(xs)) if d not in picked]
    if picked == list(range(picked[0], picked[-1] + 1)):  # adjacent: in place
        out = ins[:picked[0]] + idx + ins[picked[-1] + 1:]
    else:
        out = idx + kept
    tensors, in_letters = [x], [ins]
    for d in picked:
        tensors.append(indices[d])
        in_letters.append(_broadcast_letters(L, idx, _shape(indices[d])))
    return _einsum(L, tensors, in_letters, [out])


def _index_put(node: fx.Node) -> Signature:
    """x[indices] = values (in place or not): indexed dims of x and the positions
    written stay whole; other dims keep their split."""
    x, indices, values = node.args[0], list(node.args[1]), node.args[2]
    xs = _shape(x)
    picked = [d for d, i in enumerate(indices) if i is not None]
    idx_shape = list(torch.broadcast_shapes(*(tuple(_shape(indices[d])) for d in picked)))
    L = _Letters()
    ins = L.dims(xs)
    L.fix(*(ins[d] for d in picked))
    idx = [L.new(s, shardable=False) for s in idx_shape]
    if picked == list(range(picked[0], picked[-1] + 1)):
        written = ins[:picked[0]] + idx + ins[picked[-1] + 1:]
    else:
        written = idx + [ins[d] for d in range(len(xs)) if d not in picked]
    tensors, in_letters = [x], [ins]
    for d in picked:
        tensors.append(indices[d])
        in_letters.append(_broadcast_letters(L, idx, _shape(indices[d])))
    if _is_tensor(values):
        tensors.append(values)
        in_letters.append(_broadcast_letters(L, written, _shape(values)))
    return _einsum(L, tensors, in_letters, [ins])


def _index_select(node: fx.Node) -> Signature:
    x, index = node.args[0], node.args[2]
    xs = _shape(x)
    dim = _norm_dim(node.args[1], len(xs))
    L = _Letters()
    ins = L.dims(xs)
    L.fix(ins[dim])
    i = L.new(_shape(index)[0]) if _shape(index) else None
    out = ins[:dim] + ([i] if i is not None else []) + ins[dim + 1:]
    return _einsum(L, [x, index], [ins, [i] if i is not None else []], [out])


def _gather(node: fx.Node) -> Signature:
    """gather(x, dim, index): the output has the index's shape and split; x's
    gathered dim stays whole, its other dims split like the index's."""
    x, index = node.args[0], node.args[2]
    xs, ids = _shape(x), _shape(index)
    dim = _norm_dim(node.args[1], len(xs))
    L = _Letters()
    idx = L.dims(ids)
    ins = []
    for d, size in enumerate(xs):
        if d != dim and size == ids[d]:
            ins.append(idx[d])
        else:
            if d != dim:
                L.fix(idx[d])
            ins.append(L.new(size, shardable=False))
    return _einsum(L, [x, index], [ins, idx], [idx])


def _scatter(node: fx.Node) -> Signature:
    """scatter/scatter_add/scatter_reduce(self, dim, index, src): the scattered
    dim and the index's extent stay whole; dims of full extent keep their split."""
    x, index = node.args[0], node.args[2]
    src = node.args[3] if len(node.args) > 3 else None
    xs, ids = _shape(x), _shape(index)
    dim = _norm_dim(node.args[1], len(xs))
    L = _Letters()
    ins = L.dims(xs)
    L.fix(ins[dim])
    idx = [ins[d] if d != dim and ids[d] == xs[d] else L.new(ids[d], shardable=False)
           for d in range(len(ids))]
    tensors, in_letters = [x, index], [ins, idx]
    if _is_tensor(src):
        ss = _shape(src)
        tensors.append(src)
        in_letters.append([idx[d] if ss[d] == ids[d] else L.new(ss[d], shardable=False)
                           for d in range(len(ss))])
    return _einsum(L, tensors, in_letters, [ins])


def _histc(node: fx.Node) -> Signature:
    """Counts add up over shards of the input (a partial sum), when the range is
    given; with min == max the range is the data's own, so the input stays whole."""
    x = node.args[0]
    bins = int(_arg(node, 1, "bins", 100))
    lo, hi = _arg(node, 2, "min", 0), _arg(node, 3, "max", 0)
    L = _Letters()
    ins = [L.new(s, shardable=lo != hi) for s in _shape(x)]
    return _einsum(L, [x], [ins], [[L.new(bins, shardable=False)]])


def _min_max(node: fx.Node) -> Signature:
    """min/max: of two tensors (elementwise), along a dim (values and indices, the
    dim whole) or of everything (the input whole)."""
    if len(node.args) > 1 and _is_tensor(node.args[1]):
        return _elementwise(node)
    if isinstance(_val(node), (list, tuple)):  # values and indices
        sig = _reduction(node, linear=False)
        sig.output_letters = sig.output_letters * len(_val(node))
        return sig
    L = _Letters()
    ins = [L.new(s, shardable=False) for s in _shape(node.args[0])]
    return _einsum(L, [node.args[0]], [ins], [[]])


def _arg_reduction(node: fx.Node) -> Signature:
    if _arg(node, 1, "dim") is None:
        L = _Letters()
        ins = [L.new(s, shardable=False) for s in _shape(node.args[0])]
        return _einsum(L, [node.args[0]], [ins], [[]])
    return _reduction(node, linear=False)


def _spatial(node: fx.Node, n: int) -> Signature:
    """Pooling and upsampling over the last ``n`` dims: the leading (batch,
    channel) dims split, the spatial ones stay whole."""
    x = node.args[0]
    xs = _shape(x)
    L = _Letters()
    lead = L.dims(xs[:-n])
    ins = lead + [L.new(s, shardable=False) for s in xs[-n:]]
    vals = _val(node) if isinstance(_val(node), (list, tuple)) else [_val(node)]
    outs = []
    for val in vals:
        shape = [int(s) for s in val.shape]
        if shape[:-n] != xs[:-n]:
            raise TypeError(f"{node.name}: leading dims change")
        outs.append(lead + [L.new(s, shardable=False) for s in shape[-n:]])
    return _einsum(L, [x], [ins], outs)


def _conv_transpose(node: fx.Node) -> Signature:
    return _conv(node, transposed=True)


def _recurrent(node: fx.Node) -> Signature:
    """lstm/gru/rnn as whole ops split on the batch only (the weights' gradients
    are then partial over it). With dropout between layers in training, the
    batch stays whole too, so that the masks are the serial model's."""
    x, hx, params = node.args[0], node.args[1], node.args[2]
    dropout, train, batch_first = node.args[5], node.args[6], node.args[8]
    hx = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    xs = _shape(x)
    L = _Letters()
    batch_dim = (0 if batch_first else 1) if len(xs) == 3 else None
    b = L.new(xs[batch_dim], shardable=not (dropout and train)) if batch_dim is not None else None

    def letters(shape, dim):
        return [b if d == dim else L.new(s, shardable=False) for d, s in enumerate(shape)]

    tensors = [x, *hx, *params]
    ins = [letters(xs, batch_dim)] + [letters(_shape(h), 1 if b is not None else None)
                                      for h in hx]
    ins += [letters(_shape(p), None) for p in params]
    outs = [letters([int(s) for s in v.shape], batch_dim if i == 0 else 1)
            for i, v in enumerate(_val(node))]
    return _einsum(L, tensors, ins, outs)


def _grouped_mm(node: fx.Node) -> Signature:
    """Grouped matmul of a mixture of experts: x[t, k] (rows sorted by expert),
    w[e, k, n], offs[e] (row ends) -> [t, n]. Experts split (expert
    parallelism): each shard computes the rows of its experts, zeros elsewhere, a
    partial sum (generate/localize.py); k splits as a contraction, n as columns."""
    x, w, offs = node.args[0], node.args[1], _arg(node, 2, "offs")
    xs, ws = _shape(x), _shape(w)
    if len(xs) != 2 or len(ws) != 3 or not _is_tensor(offs):
        raise TypeError("only the 2-D x 3-D grouped matmul with offsets")
    if len(node.args) > 3 and node.args[3] is not None:
        raise TypeError("grouped matmul with a bias")
    L = _Letters()
    t, k, e, n = L.new(xs[0], shardable=False), L.new(xs[1]), L.new(ws[0]), L.new(ws[2])
    ends = L.new(_shape(offs)[0], shardable=False)
    return _einsum(L, [x, w, offs], [[t, k], [e, k, n], [ends]], [[t, n]])


def _complex_view(node: fx.Node, to_complex: bool) -> Signature:
    """view_as_complex ([..., 2] -> [...]) and view_as_real (the reverse)."""
    x = node.args[0]
    L = _Letters()
    if to_complex:
        lead = L.dims(_shape(x)[:-1])
        return _einsum(L, [x], [lead + [L.new(2, shardable=False)]], [lead])
    lead = L.dims(_shape(x))
    return _einsum(L, [x], [lead], [lead + [L.new(2, shardable=False)]])


def _replicated(node: fx.Node) -> Signature:
    """Run whole on every device, by design: bodies of higher-order ops (a
    rotary table computed without gradients) are cheap and opaque."""
    return Signature("replicate", [_ref(a) for a in _flat_args(node) if _is_tensor(a)])


def _fft(node: fx.Node) -> Signature:
    # fft_*(x, n|s, dim|dims, norm): transformed dims stay whole.
    family = op_family(node)
    many = family.endswith("fftn") or family.endswith("fft2")
    default = [-2, -1] if family.endswith("fft2") else (None if many else -1)
    return _along(node, whole_dims=_dim_arg(node, 2, "dim", default))


def _autograd_function(node: fx.Node, function) -> Signature:
    """A custom autograd.Function kept whole (trace/functions.py): split like an
    elementwise op when its forward and backward ran only pointwise ops while
    tracing (a straight-through estimator), else run whole."""
    tensors = [t for t in node.args[0] if _is_tensor(t)]
    outs = [[int(s) for s in v.shape] for v in _val(node)]
    unknown = function is None or function.backward_ops is None
    ops = {"?"} if unknown else function.forward_ops | function.backward_ops
    pointwise = ops <= (_ELEMENTWISE - _RANDOM) | _POINTWISE_HELPERS
    if not outs or not pointwise or any(o != outs[0] for o in outs):
        return Signature("replicate", [_ref(t) for t in tensors])
    try:
        torch.broadcast_shapes(*(tuple(_shape(t)) for t in tensors), tuple(outs[0]))
    except RuntimeError:
        return Signature("replicate", [_ref(t) for t in tensors])
    L = _Letters()
    out = L.dims(outs[0])
    return _einsum(L, tensors, [_broadcast_letters(L, out, _shape(t)) for t in tensors],
                   [out for _ in outs])


def _view(node: fx.Node) -> Signature:
    x = node.args[0]
    return Signature("view", [_ref(x)])


def _expand(node: fx.Node) -> Signature:
    return _elementwise(node)


def _from_nothing(node: fx.Node) -> Signature:
    return Signature("source", [])


_ELEMENTWISE = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "relu", "relu_", "gelu",
    "silu", "tanh", "sigmoid", "exp", "log", "sqrt", "rsqrt", "pow", "abs", "where",
    "masked_fill", "masked_fill_", "maximum", "minimum", "clone", "contiguous", "alias",
    "detach", "dropout", "_to_copy", "to", "type_as", "eq", "ne", "lt", "le", "gt", "ge",
    "__and__", "__or__", "logical_not", "logical_and", "bitwise_not", "clamp", "hardtanh",
    "leaky_relu", "erf", "square", "reciprocal", "fill", "zeros_like", "ones_like",
    "full_like", "_assert_tensor_metadata", "copy",
    # In place, activations, rounding, integer and complex arithmetic.
    "copy_", "fill_", "zero_", "clamp_", "clamp_min", "clamp_max", "hardtanh_", "leaky_relu_",
    "hardswish", "hardswish_", "hardsigmoid", "hardsigmoid_", "silu_", "gelu_", "sigmoid_",
    "tanh_", "elu", "elu_", "selu", "celu", "softplus", "mish", "log1p", "expm1", "exp2",
    "log2", "log10", "sin", "cos", "atan", "floor", "ceil", "round", "trunc", "sign",
    "floor_divide", "remainder", "fmod", "bitwise_and", "bitwise_or", "bitwise_xor",
    "logical_or", "logical_xor", "isnan", "isinf", "nan_to_num", "lerp", "addcmul",
    "addcdiv", "rsub", "true_divide", "neg_", "abs_", "pow_", "threshold", "erfinv",
    "empty_like", "real", "imag", "conj", "conj_physical", "angle", "polar", "complex",
    "exp_", "log_", "sqrt_", "rsqrt_", "reciprocal_", "masked_scatter", "__xor__",
    # Random: drawn whole from the serial model's generator, shards kept (ops.py).
    "dropout_", "rand_like", "randn_like",
}

_RANDOM = {"dropout", "dropout_", "bernoulli", "rand_like", "randn_like"}
#: Ops a pointwise custom Function may run besides elementwise ones.
_POINTWISE_HELPERS = {"ones_like", "zeros_like", "empty_like", "alias", "detach", "clone",
                      "lift_fresh", "_to_copy"}

_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze"}
_SOURCES = {"arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros", "new_full",
            "new_empty", "scalar_tensor", "rand", "randn", "lift_fresh_copy"}


def op_family(node: fx.Node) -> str:
    """The aten op name without namespace and overload (``aten.add.Tensor`` -> ``add``)."""
    target = node.target
    name = getattr(target, "__name__", str(target))
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
    return name.split(".")[0]


def signature(node: fx.Node) -> Signature | None:
    """The signature of a call_function node, or None when automap has no generator."""
    name = op_family(node)
    if name == "getitem":
        return _getitem(node)
    if not isinstance(_val(node), (torch.Tensor, list, tuple)):
        return None
    try:
        if name in _SOURCES or not any(_is_tensor(a) for a in _flat_args(node)):
            return _from_nothing(node)
        if name in _ELEMENTWISE:
            return _elementwise(node)
        if name in _VIEWS:
            return _view(node)
        if name.startswith(functions.OP_PREFIX):
            return _autograd_function(node, functions.FUNCTIONS.get(name))
        builder = _BUILDERS.get(name)
        return builder(node) if builder is not None else None
    except (IndexError, TypeError, KeyError):
        return None


_BUILDERS = {
    "linear": _linear,
    "mm": lambda n: _matmul_like(n, n.args[0], n.args[1], None),
    "bmm": lambda n: _matmul_like(n, n.args[0], n.args[1], None),
    "matmul": lambda n: _matmul_like(n, n.args[0], n.args[1], None),
    "addmm": lambda n: _matmul_like(n, n.args[1], n.args[2], n.args[0]),
    "baddbmm": lambda n: _matmul_like(n, n.args[1], n.args[2], n.args[0]),
    "sum": lambda n: _reduction(n, linear=True),
    "mean": lambda n: _reduction(n, linear=True),
    "amax": lambda n: _reduction(n, linear=False),
    "amin": lambda n: _reduction(n, linear=False),
    "var": lambda n: _reduction(n, linear=False),
    "std": lambda n: _reduction(n, linear=False),
    "softmax": _softmax,
    "_softmax": _softmax,
    "log_softmax": _softmax,
    "_log_softmax": _softmax,
    # bernoulli(x, p) draws with probability p; bernoulli(x) with probabilities x.
    "bernoulli": lambda n: _elementwise(n) if isinstance(_arg(n, 1, "p"), float) else
    _along(n, whole_dims=range(_val(n).dim())),
    "logsumexp": _logsumexp,
    "cumsum": lambda n: _along(n, whole_dims=[n.args[1]]),
    "cumprod": lambda n: _along(n, whole_dims=[n.args[1]]),
    "sort": lambda n: _along(n, whole_dims=[_arg(n, 1, "dim", -1)]),
    "argsort": lambda n: _along(n, whole_dims=[_arg(n, 1, "dim", -1)]),
    "topk": lambda n: _along(n, whole_dims=[_arg(n, 2, "dim", -1)]),
    "diff": lambda n: _along(n, whole_dims=[_arg(n, 2, "dim", -1)],
                             extra=(_arg(n, 3, "prepend"), _arg(n, 4, "append"))),
    "pad": _along,
    "constant_pad_nd": _along,
    "roll": lambda n: _along(n, whole_dims=_dim_arg(n, 2, "dims", None)),
    "flip": lambda n: _along(n, whole_dims=_dim_arg(n, 1, "dims", None)),
    "narrow": _along,
    "repeat": _repeat,
    "stack": _stack,
    "index": _index,
    "index_put": _index_put,
    "index_put_": _index_put,
    "index_select": _index_select,
    "gather": _gather,
    "scatter": _scatter,
    "scatter_": _scatter,
    "scatter_add": _scatter,
    "scatter_add_": _scatter,
    "scatter_reduce": _scatter,
    "histc": _histc,
    "min": _min_max,
    "max": _min_max,
    "argmax": _arg_reduction,
    "argmin": _arg_reduction,
    "conv_transpose1d": _conv_transpose,
    "conv_transpose2d": _conv_transpose,
    "conv_transpose3d": _conv_transpose,
    "lstm": _recurrent,
    "gru": _recurrent,
    "rnn_tanh": _recurrent,
    "rnn_relu": _recurrent,
    "_grouped_mm": _grouped_mm,
    "grouped_mm": _grouped_mm,
    "grouped_mm_fallback": _grouped_mm,
    "view_as_complex": lambda n: _complex_view(n, to_complex=True),
    "view_as_real": lambda n: _complex_view(n, to_complex=False),
    "numpy_T": lambda n: _permute(n, list(range(len(_shape(n.args[0])))[::-1])),
    "wrap_with_set_grad_enabled": _replicated,
    "wrap_with_autocast": _replicated,
    "unbind": lambda n: _split(n, dim_position=1),
    "chunk": _split,
    **{f"fft_{kind}{suffix}": _fft for kind in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
       for suffix in ("", "2", "n")},
    "tril": lambda n: _elementwise_single(n, fixed=[-2, -1]),
    "triu": lambda n: _elementwise_single(n, fixed=[-2, -1]),
    "layer_norm": _layer_norm,
    "rms_norm": _layer_norm,
    "embedding": _embedding,
    "conv1d": _conv,
    "conv2d": _conv,
    "conv3d": _conv,
    "batch_norm": _batch_norm,
    **{f"{op}{n}d": (lambda node, n=n: _spatial(node, n)) for n in (1, 2, 3) for op in (
        "adaptive_avg_pool", "adaptive_max_pool", "avg_pool", "max_pool", "upsample_nearest",
        "upsample_bilinear", "upsample_bicubic", "upsample_linear", "upsample_trilinear",
        "_upsample_nearest_exact", "_upsample_bilinear",
    )},
    **{f"max_pool{n}d_with_indices": (lambda node, n=n: _spatial(node, n)) for n in (1, 2, 3)},
    "scaled_dot_product_attention": _sdpa,
    "permute": lambda n: _permute(n, [_norm_dim(d, len(_shape(n.args[0]))) for d in n.args[1]]),
    "transpose": _transpose,
    "t": lambda n: _permute(n, [1, 0]) if len(_shape(n.args[0])) == 2 else _view(n),
    "slice": _slice,
    "select": _select,
    "cat": _cat,
    "split": _split,
    "split_with_sizes": _split,
    "expand": _expand,
    "cross_entropy_loss": _cross_entropy,
    "nll_loss": _cross_entropy,
    "nll_loss_nd": _cross_entropy,
}


def _wrapped_subgraph(node: fx.Node, attrs: dict | None = None
                      ) -> tuple[fx.GraphModule, tuple] | None:
    """A higher-order op's subgraph (an attribute of the graph's module, or of
    ``attrs`` for a graph still being built, read by one of its arguments) and
    the operands after it, or None."""
    if not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    owner = node.graph.owning_module
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            target = str(arg.target)
            sub = attrs.get(target) if attrs is not None and target in attrs else \
                getattr(owner, target, None) if owner is not None else None
            if isinstance(sub, fx.GraphModule):
                return sub, tuple(node.args[i + 1:])
    return None


#: Op families whose output may be a view of their first argument: an in-place
#: write into such an output writes into that argument too.
VIEWS_OF_BASE = frozenset({
    "slice", "select", "narrow", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze",
    "transpose", "permute", "t", "expand", "alias", "diagonal", "as_strided", "unflatten",
    "flatten"})


def written_args(node: fx.Node, attrs: dict | None = None) -> list[fx.Node]:
    """The tensors ``node`` writes in place: its schema's mutable arguments, a
    training batch norm's running statistics (its schema does not say so), and
    the operands a wrapped subgraph writes (``torch.no_grad()`` around an
    in-place update of a buffer exports as ``wrap_with_set_grad_enabled``: an
    EMA buffer updated there was recomputed by a checkpoint region, written
    twice, and failed autograd's version check)."""
    if node.op != "call_function":
        return []
    wrapped = _wrapped_subgraph(node, attrs)
    if wrapped is not None:
        sub, operands = wrapped
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        writes = {a for n in sub.graph.nodes for a in written_args(n)}
        return [outer for inner, outer in zip(placeholders, operands)
                if inner in writes and isinstance(outer, fx.Node)]
    if node.target is torch.ops.aten.batch_norm.default:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
        return [a for a in node.args[3:5] if isinstance(a, fx.Node)] if training else []
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                written.append(value)
    return written
