"""A kernel's scratch memory at a strategy's local shapes.

The profile measures a node's kernel scratch once, at the whole operands' shapes
(``trace/profiling.py``: ``NodeProfile.fwd_scratch`` / ``bwd_scratch``), and the
strategy table scales a node's transients by each strategy's share of its
largest operand. oneDNN's convolutions do not scale so: they reorder operands
into layouts whose channels are padded to blocks of 8 or 16, so a convolution
whose 16 input channels are split 4 ways needs more scratch than the whole one
(benches/trust.py's ResNet: 1.76 MiB at the backward of a channel-split 3x3
convolution, modelled 0.44 MiB as a quarter of the whole one's). For such a
kernel the rule that measured it is asked again with each strategy's local
operands (the kernel's measurements are cached per shape)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from automap.sharding.spec import ShardingSpec
from automap.trace.kernel_scratch import measuring_within
from automap.trace.profiling import ScratchKernel, TensorShape

_aten = torch.ops.aten

#: Local operands (and outputs) over this are estimated by the kernel's rule,
#: not run (``trace/kernel_scratch.py``): a strategy table asks hundreds of
#: local signatures (ResNet-18, 32 x 224 x 224, on (2, 2, 2): 290), each run
#: costing a convolution (3.4 s in all, 1.0 s within this limit).
LOCAL_MEASURE_LIMIT_BYTES = 4 * 2**20

#: Per kernel: which node operand each tensor argument and each tensor output
#: is (or its gradient), as ("in", k) / ("out", j); None: not an operand.
_OPERANDS: dict[Any, tuple[tuple, tuple]] = {
    # convolution(input, weight, bias, ...) -> output
    _aten.convolution.default: ((("in", 0), ("in", 1), ("in", 2)), (("out", 0),)),
    # convolution_backward(grad_output, input, weight, ...) -> input, weight, bias grads
    _aten.convolution_backward.default: ((("out", 0), ("in", 0), ("in", 1)),
                                         (("in", 0), ("in", 1), ("in", 2))),
}


def local_scratch_bytes(kernel: ScratchKernel, in_specs, out_specs, reductions, ins, outs,
                        mesh_shape) -> np.ndarray | None:
    """The scratch of ``kernel`` per strategy (``in_specs[s]``/``out_specs[s]``:
    the spec of each input and output; ``reductions[s]``: the strategy's
    partial-sum reduction, whose reduce-scatter leaves the output (and its
    gradient, gathered back for the kernel) smaller than the kernel's;
    ``ins``/``outs``: their whole shapes as ``TensorInfo``), NaN where the
    kernel refuses the local shapes, or None where its operands are not the
    node's (a kernel called inside a composite op on tensors of other shapes)."""
    maps = _OPERANDS.get(kernel.func)
    if maps is None:
        return None
    arg_map, out_map = maps
    shapes = {("in", k): tuple(i.shape) for k, i in enumerate(ins)}
    shapes.update({("out", j): tuple(o.shape) for j, o in enumerate(outs)})
    single = not isinstance(kernel.out, (tuple, list))
    values = (list(kernel.args), [kernel.out] if single else list(kernel.out))
    places: list[tuple[int, int, tuple]] = []  # (args 0 / outs 1, position, operand)
    for side, mapping in enumerate((arg_map, out_map)):
        for i, value in enumerate(values[side]):
            if isinstance(value, TensorShape):
                operand = mapping[i] if i < len(mapping) else None
                if operand is None or shapes.get(operand) != value.shape:
                    return None
                places.append((side, i, operand))
    signature = (kernel.func, _hashable(kernel.args), _hashable(kernel.out), tuple(mesh_shape),
                 torch.get_num_threads(), torch.backends.mkldnn.enabled)  # as measured
    out = np.zeros(len(in_specs))
    for s, (ispec, ospec) in enumerate(zip(in_specs, out_specs, strict=True)):
        specs = {("in", k): x for k, x in enumerate(ispec)}
        specs.update({("out", j): x for j, x in enumerate(ospec)})
        partial, scatter = reductions[s][:2] if reductions is not None else ((), None)
        raw = (scatter, math.prod(mesh_shape[a] for a in partial)) \
            if partial and scatter is not None else None
        key = (signature, raw, *(specs.get(operand) for _, _, operand in places))
        if key not in _answers:
            local = [list(values[0]), list(values[1])]
            for side, i, operand in places:
                local[side][i] = _local(values[side][i], specs.get(operand), mesh_shape,
                                        raw if operand[0] == "out" else None)
            args = tuple(_meta(a) for a in local[0])
            results = [_meta(o) for o in local[1]]
            try:
                with measuring_within(LOCAL_MEASURE_LIMIT_BYTES):
                    _answers[key] = kernel.rule(args, results[0] if single else tuple(results))
            except RuntimeError:  # local shapes the kernel refuses: NaN, scale instead
                _answers[key] = math.nan
        out[s] = _answers[key]
    return out


#: Answers per (kernel signature, mesh, local specs): repeated blocks ask the same.
_answers: dict[tuple, float] = {}


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _local(t: TensorShape, spec: str | None, mesh_shape, raw=None) -> TensorShape:
    """``t`` at its local size under ``spec`` (``raw``: (dim, group) a partial
    output's reduce-scatter splits further than the kernel sees), dense in the
    same dim order."""
    if not spec:
        return t
    dims = ShardingSpec.parse(spec).dims
    if len(dims) != len(t.shape):
        return t
    shape = [size // math.prod(mesh_shape[a] for a in axes)
             for size, axes in zip(t.shape, dims, strict=True)]
    if raw is not None:
        shape[raw[0]] *= raw[1]
    shape = tuple(shape)
    order = sorted(range(len(shape)), key=lambda d: (-t.stride[d], d))  # outermost first
    stride = [0] * len(shape)
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= max(shape[d], 1)
    return TensorShape(shape, tuple(stride), t.dtype)


def _meta(value: Any) -> Any:
    if isinstance(value, TensorShape):
        return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
    return value
