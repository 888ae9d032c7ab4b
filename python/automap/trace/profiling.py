"""Symbolic profiling (MAP section 4.1): FLOPs and memory of a training step without
allocating anything real.

:func:`profile` runs one whole training step of the traced graph on FakeTensors:
forward node by node, backward through autograd, then the optimizer step. A dispatch
mode sees every tensor each aten op returns and follows its storage with a weak
reference, so the live-bytes timeline is the one eager PyTorch would have: views and
in-place ops add nothing, a tensor saved for backward stays until autograd releases it,
a temporary dies when its last reference does. FLOPs come from
``torch.utils.flop_counter.FlopCounterMode`` (torch's own formulas); tensors saved for
backward from autograd's saved-tensor hooks; backward work is attributed to the forward
node whose autograd nodes run it.

Per graph node, the paper's quantities (bytes are of storages, counted once):

- ``fwd_in_bytes``: the node's inputs it saves for backward (parameters, buffers and
  constants excluded: they are counted as parameter/buffer memory). A tensor several
  nodes save (an in-place ReLU's output, saved again by the next convolution) counts
  for the first of them only: summed over nodes, saved bytes are the bytes kept.
- ``fwd_tmp_bytes``: tensors the node creates and saves for backward that are not its
  outputs (e.g. BatchNorm's batch statistics, a dropout mask); they live until the
  node's backward.
- ``saved_input_bytes`` / ``saved_output_bytes``: ``fwd_in_bytes`` by input node, and
  the node's own outputs it saves (a tanh saves its result), by output index.
- ``fwd_tmp_input_bytes``: the part of ``fwd_tmp_bytes`` shaped as one of the node's
  smaller inputs, by that input node (attention's float copy of a boolean mask).
- ``fwd_out_bytes``: new storage of the node's outputs. Views and in-place ops have
  none: a ``relu_`` after BatchNorm writes into BatchNorm's output, which therefore is
  kept once (the paper's in-place nuance), and appears as the ``relu_``'s ``fwd_in``.
- ``fwd_buffer_bytes``: transient storage during the node's forward, freed when it ends.
- ``bwd_tmp_bytes``: transient storage during the node's backward, freed when it ends.
- ``bwd_out_bytes``: storage the node's backward creates that outlives it: the
  gradients of its inputs (and of parameters, when a gradient is accumulated).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from automap.errors import AutomapError, TraceError
from automap.progress import stage
from automap.trace.causal_mask import CAUSAL_MASK, causal_call
from automap.trace.cpu_on_meta import ATTENTION_OPS, cpu_attention, step_on_meta
from automap.trace.fake_mode import StorageFaithfulFakeMode
from automap.trace.kernel_scratch import measured_scratch
from automap.trace.tracing import TracedGraph, default_loss, trace

log = logging.getLogger(__name__)

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"

#: The optimizers known by name, built with the keywords that choose their
#: kernels (``IMPL_KEYWORDS``); ``sgd_momentum`` keeps one momentum buffer per
#: parameter, ``adam``/``adamw`` two moments and a step counter.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, kernels: torch.optim.SGD(params, lr=1e-2, **kernels),
    "sgd_momentum": lambda params, kernels: torch.optim.SGD(
        params, lr=1e-2, momentum=0.9, **kernels
    ),
    "adam": lambda params, kernels: torch.optim.Adam(params, **kernels),
    "adamw": lambda params, kernels: torch.optim.AdamW(params, **kernels),
}
#: The constructor keywords of torch's optimizers per kernel choice
#: (``trace.optimizer_names.OPTIMIZER_IMPLS`` but "auto").
IMPL_KEYWORDS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True},
                 "fused": {"fused": True}}

OptimizerArg = str | Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None


@dataclass
class NodeProfile:
    """The profile of one graph node (see the module docstring for the quantities)."""

    name: str
    op: str
    module_path: str
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_in_bytes: int = 0
    fwd_tmp_bytes: int = 0
    fwd_out_bytes: int = 0
    fwd_buffer_bytes: int = 0
    bwd_tmp_bytes: int = 0
    bwd_out_bytes: int = 0
    #: ``fwd_in_bytes`` by the input node whose tensor is saved (a sharded plan
    #: keeps each at the local size of the spec that input arrives in).
    saved_input_bytes: dict[str, int] = field(default_factory=dict)
    #: The node's own outputs it saves for its backward (tanh, sigmoid, exp...),
    #: by output index; not part of ``fwd_tmp_bytes``.
    saved_output_bytes: dict[int, int] = field(default_factory=dict)
    #: The part of ``fwd_tmp_bytes`` shaped as one of the node's inputs, by
    #: that input node (attention's float copy of its boolean mask): a
    #: sharded plan splits it as that input, not as the largest operand.
    fwd_tmp_input_bytes: dict[str, int] = field(default_factory=dict)
    #: Parameters and buffers the node saves, by input node: no memory of their
    #: own on one device, but a sharded plan that converts one (gathers a weight)
    #: keeps the converted copy for the backward.
    saved_state_bytes: dict[str, int] = field(default_factory=dict)
    #: Activations the node saves that an earlier node saves too (counted there),
    #: by input node: a projection saving the attention output it reads. A plan
    #: that converts one for this node keeps the converted copy as well.
    shared_saved_bytes: dict[str, int] = field(default_factory=dict)
    #: The kernel scratch inside ``fwd_buffer_bytes`` / ``bwd_tmp_bytes`` (the
    #: scratch at that window's peak) and the kernel that needed it, where its
    #: scratch depends on the operands' shapes other than in proportion (oneDNN
    #: pads channels to blocks: a convolution split 4 ways by input channels
    #: needs more scratch than the whole one): a sharded plan asks the kernel's
    #: rule again at its local shapes (``solve/local_scratch.py``).
    fwd_scratch: ScratchKernel | None = None
    bwd_scratch: ScratchKernel | None = None


@dataclass(frozen=True)
class TensorShape:
    """A kernel operand's shape, strides and dtype (what its scratch rule reads)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ScratchKernel:
    """One kernel call's scratch bytes, its ``rule`` (a ``WORKSPACE`` entry) and
    its operands: ``args`` and ``out`` with every tensor as a ``TensorShape``."""

    nbytes: int
    func: Any
    rule: Callable[[tuple, Any], int]
    args: tuple
    out: Any


@dataclass(frozen=True)
class PeakLocation:
    """Where the memory peak of the step occurs: the phase (forward, backward or
    optimizer) and the graph node running then (``""`` outside any node, e.g. the
    optimizer step or the seeding of backward)."""

    phase: str
    node: str
    module_path: str


@dataclass
class Profile:
    """The symbolic profile of one training step on one device.

    Memory is in bytes of live tensor storage. ``peak_memory_bytes`` is the peak of a
    steady-state step (the optimizer state already exists), ``peak_location`` says where
    it occurs and ``peak_breakdown`` splits it: ``parameters``, ``buffers``, ``inputs``,
    ``optimizer_state``, ``gradients`` (of parameters), ``activations`` (made in the
    forward), ``backward`` (other tensors made in the backward: gradients of
    activations), ``optimizer_step`` (its temporaries) and ``workspace`` (kernel scratch
    memory, see ``WORKSPACE``). ``phase_peak_bytes`` is the peak of each phase.
    ``step_flops`` is forward plus backward FLOPs as counted by ``FlopCounterMode`` (the
    optimizer's elementwise work is not counted there)."""

    traced: TracedGraph
    device: str
    optimizer: str
    nodes: list[NodeProfile]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    input_bytes: int
    peak_memory_bytes: int
    peak_location: PeakLocation
    peak_breakdown: dict[str, int]
    phase_peak_bytes: dict[str, int]
    fwd_flops: int
    bwd_flops: int
    by_name: dict[str, NodeProfile] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_name = {n.name: n for n in self.nodes}

    @property
    def step_flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    @property
    def activation_peak_bytes(self) -> int:
        """What the step adds on top of the persistent state (parameters, buffers,
        inputs, optimizer state) at its peak."""
        persistent = ("parameters", "buffers", "inputs", "optimizer_state")
        return self.peak_memory_bytes - sum(self.peak_breakdown[k] for k in persistent)

    def to_dicts(self) -> list[dict[str, Any]]:
        """The per-node table as a list of plain dicts."""
        def plain(node: NodeProfile) -> dict[str, Any]:
            kernels = {"fwd_scratch": node.fwd_scratch, "bwd_scratch": node.bwd_scratch}
            row = asdict(replace(node, fwd_scratch=None, bwd_scratch=None))
            for name, kernel in kernels.items():  # its bytes; the kernel is not data
                row[name] = None if kernel is None else {"nbytes": kernel.nbytes,
                                                         "kernel": str(kernel.func)}
            return row

        return [plain(n) for n in self.nodes]

    def summary(self) -> dict[str, Any]:
        """The whole-step numbers as a plain dict."""
        return {
            "model": self.traced.model_type,
            "device": self.device,
            "optimizer": self.optimizer,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "buffer_bytes": self.buffer_bytes,
            "input_bytes": self.input_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_location": asdict(self.peak_location),
            "peak_breakdown": dict(self.peak_breakdown),
            "phase_peak_bytes": dict(self.phase_peak_bytes),
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "step_flops": self.step_flops,
        }

    def to_json(self, path: str | None = None) -> str:
        """Summary and per-node table as JSON; also written to ``path`` when given."""
        text = json.dumps({"summary": self.summary(), "nodes": self.to_dicts()}, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def memory_breakdown(self) -> str:
        """The per-device memory of the step, one line per kind of tensor."""
        loc = self.peak_location
        where = loc.phase + (f", node {loc.node}" if loc.node else "")
        where += f" in {loc.module_path}" if loc.module_path else ""
        rows = [
            ("parameters", self.parameter_bytes),
            ("gradients", self.gradient_bytes),
            (f"optimizer state ({self.optimizer})", self.optimizer_state_bytes),
            ("buffers", self.buffer_bytes),
            ("inputs", self.input_bytes),
            ("peak of a training step", self.peak_memory_bytes),
        ]
        rows += [(f"  {kind} at the peak", b) for kind, b in self.peak_breakdown.items()]
        lines = [f"{label:<34}{format_bytes(b):>12}" for label, b in rows]
        lines.insert(5, "")
        lines.append(f"peak occurs in the {where}")
        lines.append(
            f"step FLOPs: {self.step_flops:.4g} (forward {self.fwd_flops:.4g}, "
            f"backward {self.bwd_flops:.4g})"
        )
        return "\n".join(lines)

    def table(self, max_rows: int | None = None) -> str:
        """The per-node table as aligned text (all rows unless ``max_rows``)."""
        cols = ("name", "op", "module_path", "fwd_flops", "bwd_flops", "fwd_in_bytes",
                "fwd_tmp_bytes", "fwd_out_bytes", "fwd_buffer_bytes", "bwd_tmp_bytes",
                "bwd_out_bytes")  # fmt: skip
        heads = ("node", "op", "module", "fwd_flops", "bwd_flops", "fwd_in", "fwd_tmp",
                 "fwd_out", "fwd_buf", "bwd_tmp", "bwd_out")  # fmt: skip
        shown = self.nodes if max_rows is None else self.nodes[:max_rows]
        rows = [heads] + [tuple(_cell(getattr(n, c), c) for c in cols) for n in shown]
        widths = [min(max(len(r[i]) for r in rows), 40) for i in range(len(cols))]
        lines = [
            "  ".join(
                (cell[: widths[i]].ljust(widths[i]) if i < 3 else cell.rjust(widths[i]))
                for i, cell in enumerate(row)
            )
            for row in rows
        ]
        if len(shown) < len(self.nodes):
            lines.append(f"... {len(self.nodes) - len(shown)} more nodes (Profile.table())")
        return "\n".join(lines)

    def __str__(self) -> str:
        title = f"Profile of {self.traced.model_type} on {self.device}"
        return f"{title}\n{self.memory_breakdown()}\n\n{self.table(max_rows=40)}"

    __repr__ = __str__


def format_bytes(n: int) -> str:
    """Bytes in binary units, e.g. ``1.50 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _cell(value: Any, column: str) -> str:
    if column.endswith("_bytes"):
        return format_bytes(value) if value else "-"
    if column.endswith("_flops"):
        return f"{value:.3g}" if value else "-"
    return str(value)


def profile(
    model: nn.Module,
    example_inputs: Any,
    optimizer: OptimizerArg = "adamw",
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> Profile:
    """Profile one training step of ``model`` on ``example_inputs`` symbolically.

    ``optimizer``: ``"sgd"``, ``"sgd_momentum"``, ``"adam"``, ``"adamw"``, ``None`` (no
    optimizer step) or a callable that builds a ``torch.optim.Optimizer`` from a list of
    parameters. ``loss_fn`` maps the model output to the loss (default
    :func:`automap.trace.tracing.default_loss`). ``device``: the device type the estimate is
    for (kernels differ per device, e.g. which attention kernel runs); default the
    model's device, or for a model on the meta device ``cuda`` when available, else
    ``cpu`` (estimating for ``cuda`` needs CUDA, since autograd runs even FakeTensors
    through the CUDA runtime). Nothing real is allocated and the model is not modified.
    """
    traced = trace(
        model,
        example_inputs,
        loss_fn=loss_fn or default_loss,
        attn_implementation=attn_implementation,
    )
    return profile_traced(traced, optimizer, device=_target_device(model, device))


@torch.enable_grad()  # a training step, whatever the caller's grad mode
def profile_traced(
    traced: TracedGraph, optimizer: OptimizerArg = "adamw", *, device: str | torch.device = "cpu"
) -> Profile:
    """Profile a graph from :func:`automap.trace.tracing.trace` that ends in the loss."""
    if not traced.has_loss:
        raise TraceError("profiling needs a graph that ends in the loss: trace with loss_fn=...")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # Autograd drives even FakeTensors on CUDA through the CUDA runtime.
        raise AutomapError("estimating for device 'cuda' needs CUDA here; use device='cpu'")
    if device.type not in ("cpu", "meta") and device.index is None:
        device = torch.device(device.type, 0)  # what tensors created on "cuda" report
    with stage(log, f"profiled a training step of {len(traced.nodes)} nodes on {device}"):
        if PROFILE_CPU_ON_META and step_on_meta(device, traced.graph, optimizer):
            try:
                return _profiled_step(traced, optimizer, device, torch.device("meta"))
            except Exception as exc:  # noqa: BLE001 - the FakeTensor step says what it is
                # An op that needs values (meta kernels refuse them untyped):
                # the FakeTensor step names it as a TraceError.
                log.debug("the step on meta tensors failed (%s); on FakeTensors", exc)
        with _values_are_a_trace_error():
            return _profiled_step(traced, optimizer, device, device)


#: A CPU step is profiled on meta tensors (``trace/cpu_on_meta.py``), as the
#: simulated step runs: FakeTensorMode's dispatch was about half its time.
#: False: FakeTensors on the CPU too (what the tests check it against).
PROFILE_CPU_ON_META = True


def _profiled_step(traced: TracedGraph, optimizer: OptimizerArg, device: torch.device,
                   on: torch.device) -> Profile:
    """The profile for ``device`` of one step run on tensors of ``on`` (meta
    for a CPU, else FakeTensors of ``device``)."""
    meta = on.type == "meta" and device.type != "meta"
    with contextlib.nullcontext() if meta else StorageFaithfulFakeMode(allow_non_fake_inputs=False):
        state = _make_state(traced, on)
        opt, opt_name = make_optimizer(optimizer, state.trainable(), device)
        if opt is not None:
            create_optimizer_state(opt, state.trainable())
        rec = _Recorder(traced)
        rec.track_persistent(state, opt)
        with FlopCounterMode(display=False) as flops, TrackStorage(rec, device):
            rec.flop_counter = flops
            runner = _Runner(traced, rec, on, cpu_kernels=meta)
            outputs = runner.run(*state.placeholder_values)
            loss = outputs[traced.user_output_index]
            rec.boundary(BACKWARD, "")
            loss.backward()
            gradient_bytes = rec.gradient_bytes(state.trainable())
            rec.boundary(OPTIMIZER, "")  # settles the FLOPs of the last backward node
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return rec.result(device, opt_name, gradient_bytes)


@contextlib.contextmanager
def _values_are_a_trace_error() -> Iterator[None]:
    """A ``TraceError`` where the fake step needs a tensor's values: an op whose
    output depends on the data, most often inside a custom op's backward, which
    export keeps opaque (transformers 5.17's MoE fallback calls ``.tolist()`` in
    its backward; before, the planner raised torch's untyped exception)."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        ours = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not f.filename.startswith(ours)]
        where = (f" in {frames[-1].name} ({frames[-1].filename}:{frames[-1].lineno})"
                 if frames else "")
        raise TraceError(
            f"a step on FakeTensors cannot run {getattr(exc, 'func', exc)}"
            f"{where}: it reads tensor values (data-dependent), which planning cannot "
            "know; make that code depend on shapes only (or use a version of the library "
            "defining it that does)") from exc


def _target_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class _State:
    """The fake tensors bound to the graph's placeholders."""

    placeholder_values: list[torch.Tensor]
    params: dict[str, torch.Tensor]  # canonical name -> tensor
    buffers: list[torch.Tensor]
    inputs: list[torch.Tensor]

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.params.values() if p.requires_grad]


def _make_state(traced: TracedGraph, device: torch.device) -> _State:
    params: dict[str, torch.Tensor] = {}
    buffers: list[torch.Tensor] = []
    inputs: list[torch.Tensor] = []
    shared: dict[str, torch.Tensor] = {}  # canonical name -> tensor, for tied names
    values = []
    for node in traced.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):  # a scalar input export specialised on
            values.append(val)
            continue
        info = traced.state_of(node.name)
        if info is not None and info.canonical in shared:  # a tied name: one tensor
            values.append(shared[info.canonical])
            continue
        fake = torch.empty_strided(tuple(val.shape), val.stride(), dtype=val.dtype, device=device)
        if info is None:
            fake.requires_grad_(val.requires_grad)
            inputs.append(fake)
        else:
            shared[info.canonical] = fake
            if info.kind == "parameter":
                fake.requires_grad_(info.requires_grad)
                params[info.canonical] = fake
            else:
                buffers.append(fake)
        values.append(fake)
    return _State(values, params, buffers, inputs)


def make_optimizer(
    optimizer: OptimizerArg, params: list[torch.Tensor], device: torch.device,
    impl: str = "auto",
) -> tuple[torch.optim.Optimizer | None, str]:
    """The optimizer ``optimizer`` names over ``params``, its step running the
    kernels ``impl`` names (``OPTIMIZER_IMPLS``; a callable builds its own)."""
    if optimizer is None or not params:
        return None, "none"
    if callable(optimizer):
        return optimizer(params), getattr(optimizer, "__name__", type(optimizer).__name__)
    if optimizer not in OPTIMIZERS:
        raise AutomapError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZERS)}")
    # "auto": eager PyTorch picks the multi-tensor (foreach) kernels on accelerators
    # and the per-tensor loop on CPU; their temporaries differ, so choose as it would
    # for real tensors (it cannot tell from FakeTensors).
    if impl == "auto":
        impl = "for-loop" if device.type == "cpu" else "foreach"
    return OPTIMIZERS[optimizer](params, IMPL_KEYWORDS[impl]), optimizer


def create_optimizer_state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One step on zero gradients so the state exists, as in every step after the first.
    The step runs the multi-tensor (foreach) kernels where the optimizer has them:
    they create the same state in half the FakeTensor dispatches (GPT-2 small's
    AdamW: 0.51 s against 0.94 s); the optimizer keeps its own kernels after."""
    for p in params:
        p.grad = torch.zeros_like(p)
    kernels = [group.get("foreach") for group in opt.param_groups]
    for group in opt.param_groups:
        if "foreach" in group and not group.get("fused"):  # torch refuses both
            group["foreach"] = True
    try:
        opt.step()
    finally:
        for group, foreach in zip(opt.param_groups, kernels, strict=True):
            if "foreach" in group:
                group["foreach"] = foreach
    opt.zero_grad(set_to_none=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _channels_padded(t: torch.Tensor, multiple: int) -> int:
    """Bytes of ``t`` with its channel dim (1) rounded up to ``multiple``: oneDNN's
    blocked layouts pad channels to blocks of 8 or 16."""
    if t.dim() < 2:
        return _nbytes(t)
    channels = t.shape[1]
    return _nbytes(t) // max(channels, 1) * (-(-channels // multiple) * multiple)


def _conv_forward_estimate(args: tuple, out: torch.Tensor) -> int:
    # Where the convolution is not measured (kernel_scratch): oneDNN computes the
    # output in its blocked layout (channels padded to 16) and copies it out; an
    # input of 16 channels or more is reordered into that layout first, with
    # the weight. (Fitted to the CPU allocator's events over input and output
    # channels 3-32, strides 1 and 2.)
    blocked_out = _channels_padded(out, 16)
    copies = _nbytes(args[0]) + _nbytes(args[1]) if args[0].shape[1] >= 16 else 0
    return max(blocked_out, copies + blocked_out - _nbytes(out))


def _conv_backward_estimate(args: tuple, out: Any) -> int:
    # Where the convolution is not measured: blocked copies of grad_output
    # (channels padded to 16) and the input for the weight gradient; a strided
    # convolution also holds two input-sized buffers for the input gradient.
    # Thin inputs are padded to 8 channels and kept beside a plain copy.
    grad_out, x = args[0], args[1]
    blocked_grad = _channels_padded(grad_out, 16)
    if x.shape[1] >= 16 or x.shape[1] % 8 == 0:
        copies = _nbytes(x) + blocked_grad
    else:
        copies = _channels_padded(x, 8) + blocked_grad + _nbytes(x)
    strided = any(s != 1 for s in args[4])
    return max(copies, 2 * _nbytes(x)) if strided else copies


def _measured(op: Any, estimate: Callable[[tuple, Any], int]) -> Callable[[tuple, Any], int]:
    def workspace(args: tuple, out: Any) -> int:
        return measured_scratch(op, args, out, estimate)

    return workspace


def _batch_norm_backward_workspace(args: tuple, out: Any) -> int:
    # The CPU kernel computes the input gradient through one input-sized buffer.
    return _nbytes(args[1])


def _blas_ready(t: torch.Tensor) -> bool:
    """Whether BLAS can read the matrices of ``t`` in place (row- or column-major)."""
    rows, cols = t.shape[-2], t.shape[-1]
    rs, cs = t.stride()[-2], t.stride()[-1]
    row_major = (cs == 1 or cols == 1) and rs >= max(1, cols)
    col_major = (rs == 1 or rows == 1) and cs >= max(1, rows)
    return row_major or col_major


def _matmul_copies(*operands: int) -> Callable[[tuple, Any], int]:
    def workspace(args: tuple, out: Any) -> int:
        # mm/bmm kernels copy an operand BLAS cannot read in place (e.g. the
        # expanded gradient of a sum) into a dense buffer first.
        return sum(_nbytes(args[i]) for i in operands if not _blas_ready(args[i]))

    return workspace


_aten = torch.ops.aten
_DEVICE_QUERY = torch.ops.prim.device.default

#: Operand dtypes whose CPU matmuls oneDNN runs through converted and packed
#: copies of the operands: a bf16 [256, 64] x [64, 256] weight-gradient mm
#: allocated 230,528 B beyond its 32,768 B output, where the fp32 rule says 0
#: (a bf16 MLP plan measured 7.4 % over its simulated peak).
_LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})


def _cpu_matmul(op: Any, *operands: int) -> Callable[[tuple, Any], int]:
    rule = _matmul_copies(*operands)

    def workspace(args: tuple, out: Any) -> int:
        if args[operands[0]].dtype in _LOW_PRECISION:
            return measured_scratch(op, args, out, rule)
        return rule(args, out)

    return workspace


#: Scratch memory that kernels allocate inside an op, invisible to FakeTensors (which
#: only see an op's outputs): the transient on top of the outputs, per op. The matmul
#: rule holds on every device. On the CPU, oneDNN's convolutions and its
#: low-precision matmuls are measured per argument shape (``kernel_scratch``);
#: native batch norm's rule is derived from its allocations (PyTorch profiler
#: memory events). cuDNN's algorithm-dependent workspaces are not modelled.
_MATMUL_OPERANDS = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2),
                    _aten.bmm.default: (0, 1), _aten.baddbmm.default: (1, 2)}
WORKSPACE: dict[Any, Callable[[tuple, Any], int]] = {
    op: _matmul_copies(*operands) for op, operands in _MATMUL_OPERANDS.items()}
CPU_WORKSPACE: dict[Any, Callable[[tuple, Any], int]] = {
    **{op: _cpu_matmul(op, *operands) for op, operands in _MATMUL_OPERANDS.items()},
    _aten.convolution.default: _measured(_aten.convolution.default, _conv_forward_estimate),
    _aten.convolution_backward.default: _measured(_aten.convolution_backward.default,
                                                  _conv_backward_estimate),
    _aten.native_batch_norm_backward.default: _batch_norm_backward_workspace,
}


#: Kernels whose scratch is not proportional to their operands' bytes (oneDNN's
#: blocked layouts pad channels), recorded with their operands so that a sharded
#: plan's scratch is asked at its local shapes.
SHAPED_SCRATCH = frozenset({_aten.convolution.default, _aten.convolution_backward.default})


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorShape(tuple(value.shape), tuple(value.stride()), value.dtype)
    return value


class TrackStorage(TorchDispatchMode):
    """Reports the storage of every tensor an aten op returns to the recorder, and the
    scratch memory the op's kernel needs on top of it."""

    def __init__(self, rec: _Recorder, device: torch.device) -> None:
        super().__init__()
        self.rec = rec
        self.workspace = CPU_WORKSPACE if device.type == "cpu" else WORKSPACE

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is _DEVICE_QUERY:
            # A FakeTensor's device query allocates nothing; autograd and every op
            # ask it (59 % of a simulated step's dispatches on GPT-2 small (4,4,4)).
            return func(*args)
        if func is _aten.histc.default and not args[0].is_floating_point():
            out = _integer_histc(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.rec.track(leaf)
        workspace = self.workspace.get(func)
        if workspace is not None:
            nbytes = workspace(args, out)
            self.rec.transient(nbytes, ScratchKernel(nbytes, func, workspace, *pytree.tree_map(
                _shape_of, (args, out))) if func in SHAPED_SCRATCH else None)
        return out


def _integer_histc(x: torch.Tensor, bins: int = 100, *args: Any, **kwargs: Any
                   ) -> torch.Tensor:
    """histc of integers (a mixture-of-experts router's counts, traced on meta
    for CUDA, which has the kernel): torch's meta kernel refuses them as the
    CPU one does, but only the shape matters here."""
    return x.new_empty((bins,))


@dataclass
class _Storage:
    nbytes: int
    kind: str  # parameters, buffers, inputs, optimizer_state, or the phase that made it
    node: str  # the graph node that made it ("" for none)
    born: int
    died: int | None = None


def _storage_keys(tensors: Iterable[Any]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors
            if isinstance(t, torch.Tensor) and t.layout == torch.strided}


class _Recorder:
    """The live-bytes timeline of the step and its attribution to graph nodes."""

    def __init__(self, traced: TracedGraph) -> None:
        self.traced = traced
        self.flop_counter: FlopCounterMode | None = None
        self.storages: dict[int, _Storage] = {}  # storage id -> record, live ones only
        self.all: list[_Storage] = []
        self._refs: dict[int, weakref.ref] = {}
        self.clock = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_at = (FORWARD, "")
        self.peak_clock = 0
        self.peak_scratch = 0  # kernel scratch memory (WORKSPACE) at the peak
        self.phase_peak = {FORWARD: 0, BACKWARD: 0, OPTIMIZER: 0}
        self.phase, self.node = FORWARD, ""
        self.window_peak = 0  # peak since the current node (or grad_fn) began
        self.window_scratch: ScratchKernel | None = None  # a shaped kernel's, at that peak
        self.window: list[tuple[int, _Storage]] = []  # storages made in that window
        self.flops_seen = 0
        #: Per node, the gradients its backward's grad_fns made so far (a
        #: composite op runs several: a loss's nll_loss, then log_softmax's).
        self.backward_made: dict[str, dict[int, _Storage]] = {}
        self.profiles = {
            name: NodeProfile(name, info.op, info.module_path)
            for name, info in traced.nodes.items()
        }
        self.saved: dict[str, dict[int, _Storage]] = {}  # node -> storages it saved
        self.saved_shape: dict[int, tuple[int, ...]] = {}  # storage -> shape it was saved in
        self.attributed: set[int] = set()  # saved storages already counted by a node
        self.grad_fn_owner: dict[torch.autograd.graph.Node, str] = {}
        self.param_nodes: dict[int, str] = {}
        self.grad_records: list[_Storage] = []

    # -- the timeline --

    def track(self, tensor: torch.Tensor, kind: str | None = None) -> _Storage | None:
        if tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        record = self.storages.get(key)
        if record is not None:
            return record
        self.clock += 1
        record = _Storage(storage.nbytes(), kind or self.phase, self.node, self.clock)
        self.storages[key] = record
        self.all.append(record)
        self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
        self.live_bytes += record.nbytes
        self.window.append((key, record))
        self._observe(self.live_bytes)
        return record

    def transient(self, nbytes: int, kernel: ScratchKernel | None = None) -> None:
        """Scratch memory allocated and freed inside the op that just ran
        (``kernel``: that op, where its scratch is not proportional)."""
        self._observe(self.live_bytes + nbytes, kernel)

    def _observe(self, live_bytes: int, kernel: ScratchKernel | None = None) -> None:
        if live_bytes > self.window_peak:
            self.window_peak, self.window_scratch = live_bytes, kernel
        if live_bytes > self.phase_peak[self.phase]:
            self.phase_peak[self.phase] = live_bytes
        if live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_at = live_bytes, (self.phase, self.node)
            self.peak_clock = self.clock
            self.peak_scratch = live_bytes - self.live_bytes

    def _freed(self, key: int, _ref: object) -> None:
        self._free(key)

    def _free(self, key: int) -> None:
        record = self.storages.pop(key, None)
        self._refs.pop(key, None)
        if record is not None:
            self.clock += 1
            record.died = self.clock
            self.live_bytes -= record.nbytes

    def track_persistent(self, state: _State, opt: torch.optim.Optimizer | None) -> None:
        names = [n.name for n in self.traced.graph.nodes if n.op == "placeholder"]
        for name, tensor in zip(names, state.placeholder_values, strict=True):
            self.param_nodes.setdefault(id(tensor), name)
        for kind, tensors in (
            ("parameters", state.params.values()),
            ("buffers", state.buffers),
            ("inputs", state.inputs),
            ("optimizer_state", optimizer_tensors(opt)),
        ):
            for t in tensors:
                self.node = self.param_nodes.get(id(t), "")
                self.track(t, kind)
        self.node = ""
        self.window = []

    def boundary(self, phase: str, node: str) -> None:
        """A node (or grad_fn, or phase) begins: settle FLOPs of what ran before."""
        flops = self.flop_counter.get_total_flops() if self.flop_counter else 0
        if self.node and flops != self.flops_seen:
            prof = self.profiles[self.node]
            if self.phase == FORWARD:
                prof.fwd_flops += flops - self.flops_seen
            else:
                prof.bwd_flops += flops - self.flops_seen
        self.flops_seen = flops
        self.phase, self.node = phase, node
        self.window_peak, self.window_scratch = self.live_bytes, None
        self.window = []

    def gradient_bytes(self, params: Iterable[torch.Tensor]) -> int:
        """Bytes of the parameters' gradients, now (after backward)."""
        keys = {p.grad.untyped_storage()._cdata for p in params if p.grad is not None}
        self.grad_records = [self.storages[k] for k in keys if k in self.storages]
        return sum(r.nbytes for r in self.grad_records)

    # -- forward --

    def begin_forward(self, node: str) -> None:
        self.boundary(FORWARD, node)
        self.saved[node] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        record = self.track(tensor)
        if record is not None and self.phase == FORWARD and self.node:
            key = tensor.untyped_storage()._cdata
            self.saved[self.node][key] = record
            self.saved_shape[key] = tuple(tensor.shape)
        return tensor

    def end_forward(self, node: str, out: Any, inputs: dict[str, Any] | None = None) -> None:
        """``inputs``: the node's input values by input node name, to say whose
        tensor each saved storage is."""
        prof = self.profiles[node]
        outs = {}
        out_index: dict[int, int] = {}
        tensor_leaves = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        for index, leaf in enumerate(tensor_leaves):
            if leaf.layout == torch.strided:
                key = leaf.untyped_storage()._cdata
                out_index.setdefault(key, index)
                record = self.storages.get(key)
                if record is not None and record.node == node and record.kind == FORWARD:
                    outs[key] = record
                self._own_grad_fns(leaf.grad_fn, node)
        input_of: dict[int, str] = {}
        input_shapes: dict[tuple[int, ...], str] = {}  # of inputs not shaped as the largest
        largest = max((leaf.numel() for value in (inputs or {}).values()
                       for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)),
                      default=0)
        for name, value in (inputs or {}).items():
            for leaf in pytree.tree_leaves(value):
                if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                    input_of.setdefault(leaf.untyped_storage()._cdata, name)
                    if leaf.numel() < largest:
                        input_shapes.setdefault(tuple(leaf.shape), name)
        prof.fwd_out_bytes = sum(r.nbytes for r in outs.values())
        prof.fwd_buffer_bytes = self.window_peak - self.live_bytes
        prof.fwd_scratch = self.window_scratch
        for key, record in self.saved[node].items():
            if record.kind in ("parameters", "buffers"):
                source = input_of.get(key, record.node)
                prof.saved_state_bytes[source] = prof.saved_state_bytes.get(source, 0) \
                    + record.nbytes
                continue
            if record.kind != FORWARD and record.kind != "inputs":
                continue  # optimizer state: not activations
            if key in self.attributed:  # saved by an earlier node too: it exists once
                if record.node != node:
                    source = input_of.get(key, record.node)
                    prof.shared_saved_bytes[source] = prof.shared_saved_bytes.get(source, 0) \
                        + record.nbytes
                continue
            self.attributed.add(key)
            if record.node != node:
                prof.fwd_in_bytes += record.nbytes
                source = input_of.get(key, record.node)
                prof.saved_input_bytes[source] = prof.saved_input_bytes.get(source, 0) \
                    + record.nbytes
            elif key not in outs:
                prof.fwd_tmp_bytes += record.nbytes
                shaped_as = input_shapes.get(self.saved_shape.get(key, ()))
                if shaped_as is not None:
                    prof.fwd_tmp_input_bytes[shaped_as] = \
                        prof.fwd_tmp_input_bytes.get(shaped_as, 0) + record.nbytes
            else:
                j = out_index.get(key, 0)
                prof.saved_output_bytes[j] = prof.saved_output_bytes.get(j, 0) + record.nbytes

    def _own_grad_fns(self, grad_fn: Any, node: str) -> None:
        """Attribute the autograd nodes the forward node created to it."""
        stack = [grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.grad_fn_owner:
                continue
            owner = node
            variable = getattr(fn, "variable", None)  # AccumulateGrad: a parameter's sink
            if variable is not None:
                owner = self.param_nodes.get(id(variable), node)
            self.grad_fn_owner[fn] = owner
            fn.register_prehook(lambda grads, owner=owner: self.begin_backward(owner))
            fn.register_hook(lambda grads_in, grads_out, owner=owner:
                             self.end_backward(owner, grads_in, grads_out))
            if variable is None:
                stack.extend(next_fn for next_fn, _ in fn.next_functions)

    # -- backward --

    def begin_backward(self, node: str) -> None:
        self.boundary(BACKWARD, node)

    def end_backward(self, node: str, produced: Iterable[Any], incoming: Iterable[Any]) -> None:
        """``node``'s grad_fn ended, having made the gradients ``produced`` from
        ``incoming``. An incoming gradient an earlier grad_fn of the same node
        made and this one does not pass on (log_softmax's backward reads
        nll_loss's and makes another) is a temporary of the node's backward,
        not one of its outputs: it dies once this grad_fn returns."""
        prof = self.profiles[node]
        made = self.backward_made.setdefault(node, {})
        passed = _storage_keys(produced)
        used_up = sum(made.pop(key).nbytes for key in _storage_keys(incoming) - passed
                      if key in made and made[key].died is None)
        window = {key: r for key, r in self.window if key in self.storages and r.died is None}
        made.update(window)
        prof.bwd_out_bytes += sum(r.nbytes for r in window.values()) - used_up
        if self.window_peak - self.live_bytes + used_up > prof.bwd_tmp_bytes:
            prof.bwd_tmp_bytes = self.window_peak - self.live_bytes + used_up
            prof.bwd_scratch = self.window_scratch

    # -- the result --

    def result(self, device: torch.device, opt_name: str, grad_bytes: int) -> Profile:
        def persistent(kind: str) -> int:
            return sum(r.nbytes for r in self.all if r.kind == kind)

        grads = {id(r) for r in self.grad_records}
        breakdown = dict.fromkeys(
            ("parameters", "buffers", "inputs", "optimizer_state", "gradients",
             "activations", "backward", "optimizer_step", "workspace"), 0,
        )  # fmt: skip
        breakdown["workspace"] = self.peak_scratch
        kind_names = {FORWARD: "activations", BACKWARD: "backward", OPTIMIZER: "optimizer_step"}
        for r in self.all:
            if r.born <= self.peak_clock and (r.died is None or r.died > self.peak_clock):
                kind = "gradients" if id(r) in grads else kind_names.get(r.kind, r.kind)
                breakdown[kind] += r.nbytes
        phase, node = self.peak_at
        module = self.traced.nodes[node].module_path if node else ""
        nodes = [
            p
            for name, p in self.profiles.items()
            if self.traced.state_of(name) is None and name not in self.traced.user_input_nodes
        ]
        return Profile(
            traced=self.traced,
            device=str(device),
            optimizer=opt_name,
            nodes=nodes,
            parameter_bytes=persistent("parameters"),
            gradient_bytes=grad_bytes,
            optimizer_state_bytes=persistent("optimizer_state"),
            buffer_bytes=persistent("buffers"),
            input_bytes=persistent("inputs"),
            peak_memory_bytes=self.peak_bytes,
            peak_location=PeakLocation(phase, node, module),
            peak_breakdown=breakdown,
            phase_peak_bytes=dict(self.phase_peak),
            fwd_flops=sum(p.fwd_flops for p in self.profiles.values()),
            bwd_flops=sum(p.bwd_flops for p in self.profiles.values()),
        )


def optimizer_tensors(opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if opt is None:
        return []
    return [
        leaf
        for per_param in opt.state.values()
        for leaf in pytree.tree_leaves(per_param)
        if isinstance(leaf, torch.Tensor)
    ]


class _Runner(fx.Interpreter):
    """Runs the exported graph node by node, telling the recorder where it is. Values
    are dropped after their last use, as eager Python drops its temporaries."""

    def __init__(self, traced: TracedGraph, rec: _Recorder, device: torch.device,
                 cpu_kernels: bool = False) -> None:
        super().__init__(traced.graph_module_on(device), garbage_collect_values=True)
        self.rec = rec
        self.node: fx.Node | None = None
        self.cpu_kernels = cpu_kernels  # meta tensors standing for CPU ones

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        self.rec.begin_forward(n.name)
        self.node = n
        inputs = {a.name: self.env[a] for a in n.all_input_nodes if a in self.env}
        with torch.autograd.graph.saved_tensors_hooks(self.rec.pack, _unpack):
            out = super().run_node(n)
        self.rec.end_forward(n.name, out, inputs)
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        # Attention under a constant causal mask runs as the causal kernel, as the
        # generated program runs it where the queries' sequence is whole (the
        # masked kernel also saves the mask as a float copy for its backward:
        # 1 MiB per layer that GPT-2 (4 x 256, batch 4 per rank) does not keep).
        if self.node is not None and self.node.meta.get(CAUSAL_MASK):
            args, kwargs = causal_call(args, kwargs)
        if self.cpu_kernels and target in ATTENTION_OPS:
            target = cpu_attention
        return super().call_function(target, args, kwargs)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
