"""The generated module: an fx GraphModule holding this rank's shards under the
user's parameter names, so ``module.parameters()`` feeds any optimizer as is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from automap.errors import InputMismatchError, InvalidArgumentError, TrainingModeError
from automap.generate.state import StateShard
from automap.sharding.layout import layout_path
from automap.sharding.process_groups import MeshProcessGroups
from automap.sharding.redistribute import redistribute


class ParallelModule(fx.GraphModule):
    """One rank's part of a parallel training step; ``print(module.code)`` shows it.

    Called like the traced model (same positional and keyword inputs); returns the
    traced graph's outputs (the loss), replicated on every rank. Each call first
    checks the inputs against those the plan was made for (their structure, and
    each tensor's shape and dtype: the local shard's with ``local_inputs``) and
    raises ``InputMismatchError`` naming the input, what was expected and what came.
    The train/eval mode of the model when it was traced is part of the graph
    (dropout, batch norm): ``.eval()`` on a module traced in training mode (and
    ``.train()`` on one traced in eval mode) raises ``TrainingModeError`` instead
    of running the other mode's graph; generate an eval module from a model traced
    in eval mode. Inputs that require a gradient are refused
    (``InputMismatchError``): the program returns no gradient for its inputs.
    Data-parallel gradient all-reduces run outside the graph, in ``gradient_sync``
    (bucketed, asynchronous, finished when ``backward()`` returns)."""

    plan: Any  # an automap.Plan (the planner sits above the generator: not imported)
    groups: MeshProcessGroups
    shards: dict[str, StateShard]
    #: Tied names other than the first (``lm_head.weight``) -> the shard they share.
    aliases: dict[str, str]
    #: The model's mode when it was traced (None until ``generate`` sets it).
    traced_training: bool | None = None

    def train(self, mode: bool = True) -> ParallelModule:
        if self.traced_training is not None and bool(mode) != self.traced_training:
            traced = "training" if self.traced_training else "eval"
            raise TrainingModeError(
                f"this module's graph was traced in {traced} mode, and dropout and batch "
                f"norm run as traced: .{'train' if mode else 'eval'}() would not change "
                "them. For the other mode, plan and generate a module from the model in "
                "that mode (e.g. model.eval() before autoparallelize), or evaluate the "
                "serial model")
        return super().train(mode)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module``'s casts and moves; a cast of the floating state
        (``.float()``, ``.half()``, ``.to(dtype)``) is refused: the program runs
        in the traced dtypes, and a cast state failed in its first matmul."""
        seen = set()
        for tensor in [*self.parameters(), *self.buffers()]:
            if not tensor.is_floating_point() or tensor.dtype in seen:
                continue
            seen.add(tensor.dtype)
            try:
                out = fn(torch.empty((), dtype=tensor.dtype))
            except Exception:  # a move this machine cannot make: torch says so below
                continue
            if isinstance(out, torch.Tensor) and out.dtype != tensor.dtype:
                raise InvalidArgumentError(
                    f"this module's program runs in the dtypes it was traced in ({tensor.dtype} "
                    f"state): a cast to {out.dtype} would change the state but not the "
                    "program. Cast the model before planning (model.to(dtype), then "
                    "autoparallelize), or plan with mixed_precision=...")
        return super()._apply(fn, recurse)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        """The user model's state dict (its names, tied names included), each
        parameter and buffer a ``DTensor`` view of this rank's shard with the plan's
        placements (``automap.generate.dtensor_state``), on a torch ``DeviceMesh``
        of the plan's mesh: ``torch.distributed.checkpoint`` saves it sharded, with no
        gather. The first call builds the torch mesh (collective: every rank calls it)."""
        from automap.generate import dtensor_state

        out = super().state_dict(*args, destination=destination, prefix=prefix,
                                 keep_vars=keep_vars)
        for key in [k for k in out if k.startswith(prefix)]:
            name = dtensor_state.canonical(self, key[len(prefix):])
            if name is not None and isinstance(out[key], torch.Tensor):
                out[key] = dtensor_state.as_dtensor(self, name, out[key])
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a state dict by the user's names: DTensors (this module's own, which
        ``torch.distributed.checkpoint.load`` has filled in place; those of another
        plan, gathered and cut) or whole tensors (a serial model's, cut)."""
        from automap.generate import dtensor_state

        local = {key: dtensor_state.to_local(self, key, value)
                 for key, value in state_dict.items()}
        return super().load_state_dict(local, strict=strict, assign=assign)

    def register_aliases(self, aliases: dict[str, str]) -> None:
        """Register each tied name at its place as the same tensor as its canonical
        shard, so that the state dict names every key the user's model does."""
        self.aliases = dict(aliases)
        for alias, name in aliases.items():
            shard = self.shards[name]
            value = self.get_parameter(name) if shard.kind == "parameter" else \
                self.get_buffer(name)
            *path, leaf = alias.split(".")
            module = self
            for atom in path:
                if not hasattr(module, atom):
                    module.add_module(atom, nn.Module())
                module = getattr(module, atom)
            if isinstance(value, nn.Parameter):  # a parameter shard
                module.register_parameter(leaf, value)
            else:
                module.register_buffer(leaf, value, persistent=shard.kind == "buffer")

    def full_state_dict(self, gradients: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered whole (collective: every rank of the
        mesh calls it), by the user's names, a tied weight once under its first
        name (as ``named_parameters()`` names it; ``state_dict()`` has every tied
        name); for checkpoints and checks.
        ``gradients``: the parameters' gradients instead (those that have one)."""
        out = {}
        with torch.no_grad():
            for name, shard in self.shards.items():
                if shard.kind == "constant" or (gradients and shard.kind != "parameter"):
                    continue
                local = self.get_parameter(name) if shard.kind == "parameter" else \
                    self.get_buffer(name)
                if gradients:
                    grad = local.grad
                    if grad is None:
                        continue
                    local = grad
                whole = "R" * len(shard.global_shape)
                path = layout_path(self.plan.mesh, shard.spec, whole, list(shard.global_shape),
                                   local.dtype.itemsize)
                out[name] = redistribute(local.detach(), path, self.groups).clone()
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for this module (collective: every
        rank of the mesh calls it): the norm of the whole model's gradients, every
        shard counted once, returned on every rank, and every local gradient
        scaled by the same factor. torch's function over ``module.parameters()``
        would take this rank's shards alone for the model: another norm on each
        rank, replicas drifting apart."""
        from automap.generate import grad_norm

        norm = grad_norm.check_norm_arguments(max_norm, norm_type)
        parts = self.grad_norm_parts()
        whole = self.groups.axis_group(tuple(range(self.plan.mesh.ndim)))
        device = parts[0][0].device if parts else torch.device("cpu")
        total = grad_norm.global_grad_norm(parts, norm, whole.group, device)
        return grad_norm.clip_([g for g, _ in parts], total, float(max_norm),
                               error_if_nonfinite)

    def grad_norm_parts(self, counted_elsewhere: frozenset[str] = frozenset()
                        ) -> list[tuple[torch.Tensor, float]]:
        """(gradient, share) of each parameter shard with a gradient: the share
        of the model's norm it carries, 1 over the ranks of the mesh holding an
        identical copy (0 for ``counted_elsewhere``: a tied copy another module
        counts)."""
        from automap.generate.grad_norm import shard_share

        out = []
        for name, shard in self.shards.items():
            if shard.kind != "parameter":
                continue
            grad = self.get_parameter(name).grad
            if grad is not None:
                share = 0.0 if name in counted_elsewhere else \
                    shard_share(shard.spec, self.plan.mesh)
                out.append((grad, share))
        return out

    def local_parameter_bytes(self) -> int:
        """Bytes of the parameter shards this rank holds."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


class InputCheck:
    """The inputs a generated module takes: the pytree structure of (args,
    kwargs) and per leaf (name, shape, dtype) of a tensor or the value of a
    constant the graph was specialised on. Used as a forward pre-hook."""

    def __init__(self, in_spec: pytree.TreeSpec, leaves: list[tuple[str, object]]) -> None:
        self.in_spec = in_spec
        self.leaves = leaves  # (placeholder name, (shape, dtype) or a constant)
        kwargs_spec = _child(in_spec, 1)
        self.kwarg_names = list(kwargs_spec.context) if kwargs_spec is not None else []

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        got_names = set(kwargs)
        if got_names != set(self.kwarg_names):
            # A value given by position that the example named (the tokens of
            # ``model(input_ids, labels=...)``) shows up only as a missing keyword.
            missing = sorted(set(self.kwarg_names) - got_names)
            by_position = (f" and {len(args)} positional argument(s); pass {missing} by "
                           "keyword, as the example does") if args and missing else ""
            raise InputMismatchError(
                f"the module takes keyword inputs {self.kwarg_names} (those of the plan's "
                f"example inputs), got keywords {sorted(got_names)}{by_position}")
        ordered = {k: kwargs[k] for k in self.kwarg_names}
        flat, spec = pytree.tree_flatten((tuple(args), ordered))
        if spec != self.in_spec or len(flat) != len(self.leaves):
            expected = _child(self.in_spec, 0)
            count = expected.num_leaves if expected is not None else "?"
            raise InputMismatchError(
                f"the module takes the inputs of the plan's example ({count} positional "
                f"value(s), keywords {self.kwarg_names}); got {len(args)} positional "
                f"argument(s) of another structure")
        for (name, want), value in zip(self.leaves, flat):
            if isinstance(want, tuple):
                shape, dtype = want
                if not isinstance(value, torch.Tensor):
                    raise InputMismatchError(f"input {name}: expected a tensor of shape "
                                             f"{list(shape)} and dtype {dtype}, got "
                                             f"{type(value).__name__}")
                if value.requires_grad and torch.is_grad_enabled():
                    raise InputMismatchError(
                        f"input {name} requires a gradient: the parallel program computes "
                        "the gradients of the model's parameters, not of its inputs (each "
                        "rank would hold a partial one); pass it detached")
                if tuple(value.shape) != shape or value.dtype != dtype:
                    raise InputMismatchError(
                        f"input {name}: expected shape {list(shape)} and dtype {dtype} (the "
                        f"plan was made for these), got shape {list(value.shape)} and dtype "
                        f"{value.dtype}; re-plan for new shapes or dtypes")
            elif isinstance(value, torch.Tensor) or value != want:
                raise InputMismatchError(f"input {name}: the graph was traced with the "
                                         f"constant {want!r}, got {value!r}")


def _child(spec: pytree.TreeSpec | None, index: int) -> pytree.TreeSpec | None:
    """Child ``index`` of a pytree spec (the API's name changed across torch versions)."""
    if spec is None or spec.num_children <= index:
        return None
    return spec.child(index) if hasattr(spec, "child") else spec.children_specs[index]


def register_state(root: nn.Module, name: str, value: torch.Tensor, kind: str,
                   requires_grad: bool) -> None:
    """Put ``value`` at the dotted ``name`` of ``root``, creating empty modules on the way."""
    *path, leaf = name.split(".")
    module = root
    for atom in path:
        if not hasattr(module, atom):
            module.add_module(atom, nn.Module())
        module = getattr(module, atom)
    if kind == "parameter":
        module.register_parameter(leaf, nn.Parameter(value, requires_grad=requires_grad))
    else:
        module.register_buffer(leaf, value, persistent=kind == "buffer")
