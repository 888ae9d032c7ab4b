"""``generate``: a Plan and its traced graph become this rank's ParallelModule
(the passes of build, state, checkpoint and grad_sync, in order)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from automap.generate.build import (
    GeneratedGraph,
    defer_parameter_gradient_sync,
    fuse_mean_losses,
    generate_graph,
)
from automap.generate.checkpoint import wrap_checkpoint_blocks
from automap.generate.grad_sync import GradientSync
from automap.generate.module import InputCheck, ParallelModule, register_state
from automap.generate.state import StateShard, cut, full_tensors
from automap.sharding.collectives import DEFAULT_BUCKET_BYTES
from automap.sharding.spec import ShardingSpec


def generate(traced, plan, model: nn.Module, groups, *, device=None, local_inputs: bool = False,
             seed: int = 0, grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
             ) -> ParallelModule:
    """This rank's ``ParallelModule`` for ``plan`` (made for ``traced``, the trace of
    ``model``) on the process ``groups`` of the plan's mesh.

    ``local_inputs``: the module takes this rank's shard of each input (e.g. from a
    DistributedSampler) instead of the global batch. ``seed``: initialises models
    built on the meta device, identically on every rank. ``grad_bucket_bytes``: bucket
    size of the data-parallel gradient all-reduce (None: one all-reduce per
    parameter use, in the graph)."""
    device = torch.device(device or "cpu")
    rank = dist.get_rank()

    def shard_values(shards: dict[str, StateShard]) -> dict[str, torch.Tensor]:
        fulls = full_tensors(model, traced, list(shards), seed)
        return {name: cut(fulls.pop(name), shard.spec, plan.mesh, rank).to(device)
                for name, shard in shards.items()}

    module = assemble(traced, plan, groups, rank, device, local_inputs, grad_bucket_bytes,
                      shard_values)
    module.graph._codegen = _pytree_codegen(traced)
    module.recompile()
    module.traced_training = model.training
    module.train(model.training)
    module.register_forward_pre_hook(
        _input_check(traced, module.graph, plan, rank, local_inputs), with_kwargs=True)
    return module


def assemble(traced, plan, groups, rank: int, device: torch.device, local_inputs: bool,
             grad_bucket_bytes: int | None,
             shard_values: Callable[[dict[str, StateShard]], dict[str, torch.Tensor]]
             ) -> ParallelModule:
    """The module of ``rank``: the generated graph with its checkpoint regions, the
    state shards ``shard_values`` gives for the graph's shards, and the bucketed
    gradient sync. Called flat (one argument per traced user input)."""
    out = generate_graph(traced, plan, groups, rank, device, local_inputs)
    return assemble_graph(out, traced, plan, groups, grad_bucket_bytes, shard_values)


def assemble_graph(out: GeneratedGraph, traced, plan, groups, grad_bucket_bytes: int | None,
                   shard_values: Callable[[dict[str, StateShard]], dict[str, torch.Tensor]]
                   ) -> ParallelModule:
    """The module of a generated graph ``out`` (the whole program, or one pipeline
    stage's part of it, ``automap.generate.pipeline_split``): checkpoint regions,
    state shards, the bucketed gradient sync."""
    fuse_mean_losses(out)
    deferred = defer_parameter_gradient_sync(out) if grad_bucket_bytes is not None else []
    if plan.checkpoint is not None:
        wrap_checkpoint_blocks(out.graph, out.attrs, plan.checkpoint.stages,
                               plan.checkpoint.blocks)
    root = nn.Module()
    for name, value in shard_values(out.shards).items():
        shard = out.shards[name]
        state = traced.parameters.get(name) or traced.buffers.get(name) or traced.constants[name]
        register_state(root, name, value, shard.kind, state.requires_grad)
    for attr, obj in out.attrs.items():
        setattr(root, attr, obj)
    module = ParallelModule(root, out.graph, class_name="ParallelModule")
    module.plan, module.groups, module.shards = plan, groups, out.shards
    module.register_aliases({
        state.name: state.canonical
        for state in [*traced.parameters.values(), *traced.buffers.values()]
        if state.canonical != state.name and state.canonical in out.shards})
    # Gradients come roughly in reverse order of first use.
    synced = [(module.get_parameter(name), groups.axis_group(axes))
              for name, axes in reversed(deferred) if module.get_parameter(name).requires_grad]
    setting = getattr(plan, "mixed_precision", None)
    module.gradient_sync = GradientSync(synced, grad_bucket_bytes or DEFAULT_BUCKET_BYTES,
                                        reduce_dtype=setting.reduce_dtype if setting else None)
    return module


def _input_check(traced, graph, plan, rank: int, local_inputs: bool) -> InputCheck:
    """What each input placeholder of the generated graph must receive: the
    traced (global) shape, or this rank's shard of it with ``local_inputs``."""
    leaves = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = tuple(int(s) for s in val.shape)
            spec = plan.nodes[node.name].outputs[0] if node.name in plan.nodes else None
            if local_inputs and spec is not None:
                shape = tuple(ShardingSpec.parse(spec).local_shape(list(shape), plan.mesh))
            leaves.append((node.name, (shape, val.dtype)))
        else:
            leaves.append((node.name, val))
    return InputCheck(traced.exported.call_spec.in_spec, leaves)


def _pytree_codegen(traced):
    """Forward arguments as the model takes them (positional and keyword inputs)."""
    from torch.export._unlift import _get_codegen

    spec = traced.exported.call_spec
    return _get_codegen(spec.in_spec, spec.out_spec)
