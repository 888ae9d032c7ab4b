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
    return _elementwise_single(node, fixed=[node.args[1]])


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


def _conv(node: fx.Node) -> Signature:
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 and _is_tensor(node.args[2]) else None
    groups = node.args[6] if len(node.args) > 6 else 1
    xs, ws, os_ = _shape(x), _shape(w), _shape(node)
    L = _Letters()
    b, c = L.new(xs[0]), L.new(xs[1], shardable=groups == 1)
    o = L.new(ws[0], shardable=groups == 1)
    spatial_in = [L.new(s, shardable=False) for s in xs[2:]]
    window = [L.new(s, shardable=False) for s in ws[2:]]
    spatial_out = [L.new(s, shardable=False) for s in os_[2:]]
    w_letters = [o, c if groups == 1 else L.new(ws[1], shardable=False)] + window
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


def _pool(node: fx.Node) -> Signature:
    """Pooling over spatial dims: batch and channels split, windows stay whole."""
    x = node.args[0]
    xs, os_ = _shape(x), _shape(node)
    L = _Letters()
    lead = L.dims(xs[:-2]) if len(xs) == len(os_) else None
    if lead is None:
        return Signature("replicate", [_ref(x)])
    ins = lead + [L.new(s, shardable=False) for s in xs[-2:]]
    out = lead + [L.new(s, shardable=False) for s in os_[-2:]]
    return _einsum(L, [x], [ins], [out])


def _sdpa(node: fx.Node) -> Signature:
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if len(qs) != 4 or ks[1] != qs[1]:  # grouped-query attention: heads differ
        return Signature("replicate", [_ref(t) for t in (q, k, v, mask) if _is_tensor(t)])
    L = _Letters()
    b, h = L.new(qs[0]), L.new(qs[1])
    # Queries split freely, except under a causal mask tied to absolute positions.
    s = L.new(qs[2], shardable=not is_causal)
    t = L.new(ks[2], shardable=False)
    d = L.new(qs[3], shardable=False)
    e = L.new(vs[3], shardable=False)
    tensors, ins = [q, k, v], [[b, h, s, d], [b, h, t, d], [b, h, t, e]]
    if _is_tensor(mask):
        tensors.append(mask)
        ins.append(_broadcast_letters(L, [b, h, s, t], _shape(mask)))
    return _einsum(L, tensors, ins, [[b, h, s, e]])


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
    tensors = [t for t in node.args[0] if _is_tensor(t) and _val(t).numel() > 0]
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


def _split(node: fx.Node) -> Signature:
    x = node.args[0]
    L = _Letters()
    ins = L.dims(_shape(x))
    dim = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(ins))
    L.fix(ins[dim])
    outs = []
    for piece in _val(node):
        letters = list(ins)
        letters[dim] = L.new(int(piece.shape[dim]), shardable=False)
        outs.append(letters)
    return _einsum(L, [x], [ins], outs)


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
    n = L.dims(ls[:1])
    c = L.new(ls[1], shardable=False) if len(ls) > 1 else None
    rest = L.dims(ls[2:])
    logit_letters = n + ([c] if c is not None else []) + rest
    target_letters = _broadcast_letters(L, n + rest, _shape(target))
    # Mean and sum reductions are linear: a split batch leaves partial sums.
    out = [] if reduction != 0 else n + rest
    tensors = [logits, target]
    ins = [logit_letters, target_letters]
    if len(node.args) > 2 and _is_tensor(node.args[2]):  # class weights
        tensors.append(node.args[2])
        ins.append([c])
    return _einsum(L, tensors, ins, [out])


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
}

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
    "cumsum": _softmax,
    "tril": lambda n: _elementwise_single(n, fixed=[-2, -1]),
    "triu": lambda n: _elementwise_single(n, fixed=[-2, -1]),
    "layer_norm": _layer_norm,
    "rms_norm": _layer_norm,
    "embedding": _embedding,
    "conv1d": _conv,
    "conv2d": _conv,
    "conv3d": _conv,
    "batch_norm": _batch_norm,
    "adaptive_avg_pool2d": _pool,
    "avg_pool2d": _pool,
    "max_pool2d": _pool,
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
