"""Running a pipelined plan (issue 18): this rank's stage module
(``pipeline_stage``) under a ``torch.distributed.pipelining`` schedule.

``PipelineModule`` trains with the usual loop, ``loss = module(*inputs);
loss.backward(); optimizer.step()``: its forward splits the batch into the
plan's microbatches (every tensor input along dim 0), runs the schedule's
forward and backward over all of them, sums the gradients of weights that
several stages hold (tied embeddings), and returns the batch's loss, the same
value on every rank. The gradients are then already in ``.grad``, so the
loss's backward only checks that it is the plain ``loss.backward()`` (a
gradient of 1; anything else raises ``PipelineError``). ``parameters()`` are
this rank's shards of its stage's parameters.

Gradient scale: each microbatch's loss is multiplied by its weight before its
backward (``microbatch_loss.py``: 1 / M for a mean over elements, 1 for a sum,
the microbatch's share of the kept targets for a cross-entropy), so the summed
losses and gradients are the batch's, and gradients already in ``.grad``
(accumulation over several calls) are kept as they are; the schedule's own
``scale_grads``, which divides the whole ``.grad`` at the end, is off. Batch
norm in training mode with several microbatches is refused."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.torch_version import TorchVersion

from automap.errors import InputMismatchError, InvalidPipelineError, PipelineError
from automap.generate.microbatch_loss import check_batch_statistics, microbatch_weights
from automap.generate.module import InputCheck, ParallelModule
from automap.generate.pipeline_order import interleaved_rounds
from automap.generate.pipeline_stage import BuiltStage, build_stages
from automap.generate.schedule_call import run_schedule
from automap.sharding.collectives import DEFAULT_BUCKET_BYTES

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved": ScheduleInterleaved1F1B}


def generate_pipeline(traced, plan, model: nn.Module, *, device=None, seed: int = 0,
                      grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES) -> PipelineModule:
    """This rank's ``PipelineModule`` for ``plan`` (``plan.pipeline`` set; its nodes
    made for ``traced``, the model traced on ONE microbatch). Collective over the
    world: every rank calls it."""
    record = plan.pipeline
    if record is None:
        raise InvalidPipelineError("the plan has no pipeline; use automap.generate.program."
                                   "generate for an intra-op plan")
    if record.schedule not in SCHEDULES:
        raise InvalidPipelineError(
            f"schedule {record.schedule!r} cannot run here: this runtime runs "
            f"{sorted(SCHEDULES)}")
    virtual = int(getattr(record, "virtual_stages", 1))
    n = len(record.stages) // virtual
    if record.schedule == "1f1b" and record.microbatches < n:
        raise InvalidPipelineError(
            f"1F1B needs at least as many microbatches as stages: {record.microbatches} "
            f"microbatches for {n} stages (torch's Schedule1F1B refuses it)")
    if (virtual > 1) != (record.schedule == "interleaved") or len(record.stages) % virtual:
        raise InvalidPipelineError(
            f"{len(record.stages)} chunks with {virtual} per rank under {record.schedule!r}: "
            f"only the interleaved schedule runs several chunks per rank")
    if record.schedule == "interleaved" and interleaved_rounds(record.microbatches, n) is None:
        raise InvalidPipelineError(
            f"interleaved 1F1B cannot run {record.microbatches} microbatches on {n} stages: "
            f"torch splits them into max(1, M // n) rounds, which must divide M")
    device = torch.device(device or "cpu")
    built = build_stages(traced, plan, model, device=device, seed=seed,
                         grad_bucket_bytes=grad_bucket_bytes)
    _check_received_dtypes(built)
    return PipelineModule(built, traced, plan, device)


#: The first torch whose pipelining trains a stage that receives a tensor
#: without gradients (token ids or labels a later stage reads).
RECEIVES_INTEGERS_SINCE = "2.13"


def _check_received_dtypes(built: list[BuiltStage]) -> None:
    """A ``PipelineError`` where a stage receives a non-floating-point tensor and
    this torch's pipelining cannot train it: before 2.13 every received buffer is
    made to require gradients (an integer one raises) and a gradient is sent
    back for each (an integer input has none, which raises too)."""
    if TorchVersion(torch.__version__) >= RECEIVES_INTEGERS_SINCE:
        return
    for stage in built:
        kinds = sorted({str(m.dtype) for m in stage.input_metas if not m.is_floating_point()})
        if stage.index > 0 and kinds:
            raise PipelineError(
                f"stage {stage.index} of this plan receives {', '.join(kinds)} tensors from "
                f"stage {stage.index - 1}, which torch {torch.__version__}'s pipelining "
                f"cannot train (torch >= {RECEIVES_INTEGERS_SINCE} can): upgrade torch, or "
                f"plan with pipeline='off'")


class _SendContiguous(nn.Module):
    """The stage module as the schedule calls it: what it sends is contiguous, the
    last stage's loss a tensor of shape (1,)."""

    def __init__(self, module: ParallelModule, last: bool, recompute: bool) -> None:
        super().__init__()
        self.module = module
        self.last = last
        self.recompute = recompute

    def forward(self, *args: torch.Tensor) -> Any:
        if self.recompute and torch.is_grad_enabled():
            # The plan's whole-stage checkpoint: each microbatch in flight keeps
            # its input only; the forward runs again before its backward.
            out = torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False)
        else:
            out = self.module(*args)
        if self.last:  # shape (1,): the schedule concatenates outputs (under eval)
            return out.reshape(1)
        return tuple(v.contiguous() for v in out)


def _weighted_loss(output: torch.Tensor, weight: float) -> torch.Tensor:
    """A microbatch's share of the batch's loss. Weight 0: a cross-entropy
    microbatch keeping no target, whose own mean is 0 / 0 (NaN) where the serial
    loss holds none of its terms; its backward gets a gradient of 0."""
    loss = output.sum()
    if weight == 0:
        return torch.where(torch.isnan(loss), torch.zeros_like(loss), loss) * 0.0
    return loss * weight


class _ReleasingStage(PipelineStage):
    """A ``PipelineStage`` whose last stage lets go of a microbatch's graph
    once its backward ran. torch's schedules keep every microbatch's loss to
    the end of the step (for the losses they return), and a loss keeps its
    graph's nodes, among them the accumulators of its leaves: the received
    activations, so the last stage held every microbatch's received input to
    the end of the step where the other stages free it after that backward
    (a 4-stage 1F1B pipeline's last rank: 0.75 MiB, 3 microbatch inputs,
    over its simulated step, and over its budget). Detaching the loss in place
    after its backward keeps its value and frees the graph."""

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        out = super().backward_one_chunk(*args, **kwargs)
        loss = kwargs.get("loss", args[1] if len(args) > 1 else None)
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            loss.detach_()
        return out


class _FinishedLoss(torch.autograd.Function):
    """The step's loss, whose backward already ran inside the schedule.
    ``made``: the parameter gradients that step left, checked to be still
    there: an ``optimizer.zero_grad()`` between the forward and ``backward()``
    dropped the whole step's gradients in silence (a new-user sweep)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, made) -> torch.Tensor:
        ctx.made = made
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        if not bool(torch.all(grad == 1)):
            raise PipelineError(
                "a pipelined module runs the backward of every microbatch inside its forward, "
                "for the loss itself (a gradient of 1): scaled losses (loss * c).backward() or "
                "losses combined with others cannot be differentiated afterwards; scale the "
                "learning rate instead")
        if _gradients_reset(ctx.made):
            raise PipelineError(
                "the gradients this pipelined step computed were reset between the forward "
                "and backward(): a pipelined module runs the backward inside its forward, so "
                "call optimizer.zero_grad() before the forward or after optimizer.step(), "
                "not between the forward and backward()")
        return None, None, None


def _gradients_made(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(parameter, its gradient, the gradient's version) for each parameter a
    step left a gradient on."""
    return [(p, p.grad, p.grad._version) for p in module.parameters() if p.grad is not None]


def _gradients_reset(made) -> bool:
    """Whether a gradient of ``made`` was set to None, or zeroed in place
    (changed, and all zeros: another step accumulating into it changes it
    too, but leaves no zeros)."""
    for param, grad, version in made:
        if param.grad is None:
            return True
        if param.grad is grad and grad._version != version and not bool(grad.any()):
            return True
    return False


class PipelineModule(nn.Module):
    """One rank's part of a pipelined training step (see the module docstring).
    ``module``: this rank's (first) stage (a ``ParallelModule``), ``chunks``
    every chunk it runs (interleaved: several); ``stage``: which stage and
    position; ``plan``: the plan."""

    def __init__(self, built: list[BuiltStage], traced, plan, device: torch.device) -> None:
        super().__init__()
        self.module = built[0].module
        self.chunks = nn.ModuleList([b.module for b in built])
        self.plan = plan
        self.stage = built[0]
        self.built = built
        self.microbatches = int(plan.pipeline.microbatches)
        pipes = []
        for b in built:
            last = b.index == b.count - 1
            recompute = bool(getattr(plan.pipeline.stages[b.index], "recompute", False))
            pipe = _ReleasingStage(_SendContiguous(b.module, last, recompute), b.index, b.count,
                                 device, input_args=b.input_metas, output_args=b.output_metas,
                                 group=b.p2p_group)
            pipe.stage_index_to_group_rank = dict(b.stage_to_group_rank)
            pipes.append(pipe)
        self._pipe = pipes[0]
        m = self.microbatches
        schedule = SCHEDULES[plan.pipeline.schedule]
        # Interleaved: torch places chunk j on group rank j mod n, as the plan does.
        check_batch_statistics(traced, m)
        # The schedule's targets are the microbatches' loss weights (their sum
        # is the batch's loss; microbatch_loss.py).
        self._weights = microbatch_weights(traced)
        self._schedule = schedule(
            pipes if schedule is ScheduleInterleaved1F1B else pipes[0], m,
            loss_fn=_weighted_loss, scale_grads=False)
        self._anchor = torch.zeros((), requires_grad=True)
        self._check = _batch_check(traced, m)
        self._loss_dtype = built[0].loss_dtype
        self._device = device
        self._random_state: tuple | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check(self, args, kwargs)
        m = self.microbatches
        ordered = {k: kwargs[k] for k in self._check.kwarg_names}
        leaves = pytree.tree_leaves((tuple(args), ordered))
        chunks = [torch.chunk(v, m, dim=0) if isinstance(v, torch.Tensor) else [v] * m
                  for v in leaves]
        first = self.stage.index == 0  # this rank holds the first chunk
        arg_mbs = [tuple(c[i] for c in chunks) for i in range(m)] if first else None
        if any(not isinstance(v, torch.Tensor) for v in leaves):
            raise InputMismatchError("a pipelined module takes tensor inputs only")
        losses: list[torch.Tensor] = []
        targets = self._weights(leaves, m)
        with self._stage_random():
            if torch.is_grad_enabled():
                # Data-parallel gradients are summed once, after the last microbatch.
                with contextlib.ExitStack() as deferred:
                    for chunk in self.chunks:
                        deferred.enter_context(chunk.gradient_sync.deferred())
                    run_schedule(self._schedule, arg_mbs, targets, losses, backward=True)
            else:
                run_schedule(self._schedule, arg_mbs, targets, losses, backward=False)
        if torch.is_grad_enabled():
            self._sum_shared_gradients()
        total = torch.zeros((), dtype=self._loss_dtype, device=self._device)
        if losses:
            total = torch.stack([v.detach().reshape(()) for v in losses]).sum()
        dist.broadcast(total, src=self.stage.loss_source_rank, group=self.stage.pipeline_group)
        if not torch.is_grad_enabled():
            return total
        return _FinishedLoss.apply(self._anchor, total, _gradients_made(self))

    @contextlib.contextmanager
    def _stage_random(self) -> Iterator[None]:
        """Random ops (dropout) draw from this stage's own stream: the ranks of a
        stage alike (as ``generate`` requires), other stages independently (from
        the caller's generator they would all draw the same first numbers, and
        equal-shaped dropouts of different stages would share masks). The stream
        is seeded once from the caller's generator plus the stage index and kept
        between calls; the caller's generator does not move."""
        devices = [self._device] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if self._random_state is None:
                base = int(torch.randint(0, 2**31 - 1, ()).item())
                torch.manual_seed(base + 1_000_003 * self.stage.index)
            else:
                torch.set_rng_state(self._random_state[0])
                if devices:
                    torch.cuda.set_rng_state(self._random_state[1], self._device)
            yield
            self._random_state = (torch.get_rng_state(),
                                  torch.cuda.get_rng_state(self._device) if devices else None)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        """This rank's stage's state by the user model's names (its chunks'
        parameters and buffers, each a ``DTensor`` on the stage's submesh), as a
        ``ParallelModule``'s; a weight two of its chunks tie appears once. The
        first call builds the torch meshes of every stage (collective: every rank
        of the plan calls it)."""
        self._stage_torch_meshes()
        out: dict[str, Any] = {} if destination is None else destination
        for chunk in self.chunks:
            for key, value in chunk.state_dict(keep_vars=keep_vars).items():
                out.setdefault(prefix + key, value)
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load this rank's stage's entries of ``state_dict`` (user names, as
        ``state_dict()`` gives; whole tensors or DTensors) into its chunks; with
        ``strict``, a key of the stage missing from it is an error (other
        stages' keys are expected)."""
        self._stage_torch_meshes()
        missing: list[str] = []
        for chunk in self.chunks:
            own = list(nn.Module.state_dict(chunk).keys())
            missing.extend(k for k in own if k not in state_dict)
            chunk.load_state_dict({k: state_dict[k] for k in own if k in state_dict},
                                  strict=False, assign=assign)
        if strict and missing:
            raise PipelineError(f"the state dict lacks this stage's entries {sorted(missing)}")
        return nn.modules.module._IncompatibleKeys(sorted(set(missing)), [])

    def _stage_torch_meshes(self) -> None:
        """One torch ``DeviceMesh`` over every stage (a leading stage axis over
        the submesh's axes), made by every rank in the same order, and each
        chunk's submesh sliced from it: a mesh per chunk, made by the ranks of
        its stage only, left the stages' group creations out of step (the
        interleaved schedule's state_dict hung)."""
        if getattr(self, "_stage_meshes_built", False):
            return
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

        record = self.plan.pipeline
        n = record.stage_count
        names = tuple(self.module.plan.mesh.axis_names)
        grid = torch.tensor([list(record.stages[k].ranks) for k in range(n)],
                            dtype=torch.int64).reshape(n, *record.submesh_shape)
        device = next((t.device.type for t in self.parameters()), "cpu")
        whole = TorchDeviceMesh(device, grid, mesh_dim_names=("pipeline_stage", *names))
        mine = whole[names[0]] if len(names) == 1 else whole[names]
        for chunk in self.chunks:
            if tuple(mine.mesh.flatten().tolist()) != tuple(chunk.plan.mesh.ranks):
                raise PipelineError(f"stage mesh {mine.mesh.tolist()} is not chunk "
                                    f"{chunk.plan.mesh.ranks}'s")
            chunk._torch_mesh = mine
        self._stage_meshes_built = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the pipelined model (collective:
        every rank of the plan calls it): the norm of every stage's gradients, a
        weight several stages tie counted once, the same on every rank; each
        local gradient scaled by the same factor. torch's function over
        ``module.parameters()`` would take this stage's shards alone."""
        from automap.generate import grad_norm

        norm = grad_norm.check_norm_arguments(max_norm, norm_type)
        parts = []
        for b in self.built:
            # A tied weight's later copies are scaled with the rest, counted once.
            later = frozenset(n for n, k in b.first_holder.items() if k != b.index)
            parts.extend(b.module.grad_norm_parts(counted_elsewhere=later))
        device = parts[0][0].device if parts else self._device
        total = grad_norm.global_grad_norm(parts, norm, self.stage.pipeline_group, device)
        return grad_norm.clip_([g for g, _ in parts], total, float(max_norm),
                               error_if_nonfinite)

    def _sum_shared_gradients(self) -> None:
        """Weights several chunks hold (tied) get the sum of their gradients, once:
        the copies in this rank's chunks are added here, the ranks' sums
        all-reduced over the other holders, and every copy takes the total."""
        for names, local, group in self.stage.shared:
            copies = [[self.chunks[i].get_parameter(n) for n in names] for i in local]
            flat = None
            for params in copies:
                part = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                  .reshape(-1) for p in params])
                flat = part if flat is None else flat + part
            if group is not None:
                dist.all_reduce(flat, group=group)
            for params in copies:
                offset = 0
                for p in params:
                    n = p.numel()
                    summed = flat[offset:offset + n].view_as(p)
                    if p.grad is None:
                        p.grad = summed.clone()
                    else:
                        p.grad.copy_(summed)
                    offset += n


def _batch_check(traced, microbatches: int) -> InputCheck:
    """The inputs' check: the traced (one microbatch's) shapes with dim 0 times
    the number of microbatches."""
    leaves: list[tuple[str, object]] = []
    placeholders = {n.name: n for n in traced.graph.nodes if n.op == "placeholder"}
    for name in traced.user_input_nodes:
        val = placeholders[name].meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = tuple(int(s) for s in val.shape)
            if not shape:
                raise InvalidPipelineError(f"input {name} is a scalar: pipelined inputs are "
                                           "split into microbatches along dim 0")
            leaves.append((name, ((shape[0] * microbatches, *shape[1:]), val.dtype)))
        else:
            leaves.append((name, val))
    return InputCheck(traced.exported.call_spec.in_spec, leaves)
