"""This rank's pipeline stage (issue 18): which stage and submesh position it
is, the process groups it needs, and the stage's module (its part of the
generated program, ``pipeline_split``), with the shapes of what it receives
and sends.

Every rank creates every group in one order (``torch.distributed.new_group``
is collective over the world): each stage's submesh groups, stage 0 first;
then per submesh position ``p`` the point-to-point group of the ranks at ``p``
in every stage; then per set of stages sharing a weight and per position the
group that sums its gradient. The plan is read duck-typed (``generate`` sits
below ``planner``): ``plan.pipeline.stages[k].ranks``, ``.submesh_shape``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn

from automap.errors import InvalidPlanError, PipelineError
from automap.generate.build import GeneratedGraph, generate_graph
from automap.generate.module import ParallelModule, register_state
from automap.generate.pipeline_split import cut, shared_parameters, stage_graph
from automap.generate.program import assemble_graph
from automap.generate.simulate import fake_inputs, fake_shards
from automap.generate.state import StateShard, full_tensors
from automap.generate.state import cut as cut_shard
from automap.sharding.collectives import DEFAULT_BUCKET_BYTES
from automap.sharding.mesh import DeviceMesh
from automap.sharding.process_groups import AxisGroup, MeshProcessGroups, SimulatedGroups
from automap.trace.fake_mode import StorageFaithfulFakeMode


class StagePlan:
    """The plan as one stage's ranks run it: the same nodes and choices, on that
    stage's submesh (the plan's own ``mesh`` is stage 0's)."""

    def __init__(self, plan, mesh: DeviceMesh) -> None:
        self._plan = plan
        self.mesh = mesh

    def __getattr__(self, name: str):
        return getattr(self._plan, name)


def stage_meshes(plan) -> list[DeviceMesh]:
    """Each stage's submesh: the plan mesh's shape, axes and links, the stage's ranks."""
    record, base = plan.pipeline, plan.mesh
    if tuple(record.submesh_shape) != tuple(base.shape):
        raise InvalidPlanError(f"the plan's mesh {base.shape} is not the pipeline's submesh "
                               f"shape {tuple(record.submesh_shape)}")
    meshes = []
    for k, stage in enumerate(record.stages):
        if len(stage.ranks) != base.size:
            raise InvalidPlanError(f"pipeline stage {k} has {len(stage.ranks)} ranks; its "
                                   f"submesh {base.shape} has {base.size}")
        meshes.append(DeviceMesh(base.shape, ranks=list(stage.ranks),
                                 axis_names=base.axis_names, alpha_s=base.alpha_s,
                                 bandwidth_bytes_per_s=base.bandwidth_bytes_per_s,
                                 backend=base.backend))
    return meshes


@dataclass
class BuiltStage:
    """One chunk this rank runs (its stage, unless interleaved: ``v`` chunks)."""

    index: int
    count: int
    position: int
    module: ParallelModule
    groups: MeshProcessGroups
    #: The point-to-point group of the ranks at this position in every stage,
    #: and each stage (chunk) -> its member's rank in it.
    p2p_group: object
    stage_to_group_rank: dict[int, int]
    #: Example tensors (meta) of what the stage receives and returns, per microbatch.
    input_metas: tuple[torch.Tensor, ...]
    output_metas: tuple[torch.Tensor, ...]
    #: Tied weights this rank holds in several chunks or with other ranks:
    #: (shard names, the positions in this rank's chunk list that hold them,
    #: the group of the other holders' ranks or None when only this rank's
    #: chunks hold them). The same list on every chunk of the rank.
    shared: list[tuple[list[str], list[int], object]] = field(default_factory=list)
    #: Tied weights -> the first chunk holding them (the copy a gradient norm counts).
    first_holder: dict[str, int] = field(default_factory=dict)
    #: Every rank of the pipeline, for the loss's broadcast.
    pipeline_group: object = None
    loss_source_rank: int = 0
    loss_dtype: torch.dtype = torch.float32


def build_stage(traced, plan, model: nn.Module, *, device: torch.device, seed: int = 0,
                grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES) -> BuiltStage:
    """This rank's (first) stage of ``plan``; see ``build_stages``."""
    return build_stages(traced, plan, model, device=device, seed=seed,
                        grad_bucket_bytes=grad_bucket_bytes)[0]


def build_stages(traced, plan, model: nn.Module, *, device: torch.device, seed: int = 0,
                 grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES) -> list[BuiltStage]:
    """This rank's chunks of ``plan`` (with ``plan.pipeline`` set; one unless the
    schedule is interleaved) over ``traced``, the model traced for one
    microbatch, in chunk order. Collective over the world.

    The program is generated once (every chunk of a rank runs on the same
    submesh) and cut into every chunk; each of this rank's chunks is its own
    ``ParallelModule`` with its own state shards, so a weight read by two of
    its chunks (interleaved) is held twice, from the same full tensor."""
    record = plan.pipeline
    rank = dist.get_rank()
    stages = record.stages
    meshes = stage_meshes(plan)
    mine = [k for k, s in enumerate(stages) if rank in s.ranks]
    if not mine:
        raise PipelineError(f"rank {rank} is in no stage of the pipeline "
                            f"({[list(s.ranks) for s in stages]})")
    position = list(stages[mine[0]].ranks).index(rank)

    # One set of submesh groups per submesh (an interleaved rank's chunks share
    # theirs), created on every rank in chunk order.
    by_ranks: dict[tuple[int, ...], MeshProcessGroups] = {}
    for m in meshes:
        if tuple(m.ranks) not in by_ranks:
            by_ranks[tuple(m.ranks)] = MeshProcessGroups(m)
    groups = by_ranks[tuple(stages[mine[0]].ranks)]
    p2p_group, stage_to_group_rank = None, {}
    for p in range(meshes[0].size):
        members = [s.ranks[p] for s in stages]
        ordered = sorted(set(members))
        group = dist.new_group(ranks=ordered)
        if p == position:
            p2p_group = group
            stage_to_group_rank = {k: ordered.index(r) for k, r in enumerate(members)}
    everyone = sorted({r for s in stages for r in s.ranks})
    pipeline_group = dist.new_group(ranks=everyone)

    stage_plan = StagePlan(plan, meshes[mine[0]])
    out = generate_graph(traced, stage_plan, groups, rank, device)
    stage_cut = cut(out, traced, stages)
    values = fake_values(out, traced, stage_plan, rank, device)
    loss = next(n for n in out.graph.nodes if n.op == "output").args[0][0]

    def shard_values(shards: dict[str, StateShard]) -> dict[str, torch.Tensor]:
        fulls = full_tensors(model, traced, list(shards), seed)
        return {name: cut_shard(fulls.pop(name), shard.spec, stage_plan.mesh, rank).to(device)
                for name, shard in shards.items()}

    built = []
    for index in mine:
        part = stage_graph(out, stage_cut, index)
        module = assemble_graph(part, traced, stage_plan, groups, grad_bucket_bytes,
                                shard_values)
        module.traced_training = model.training
        module.train(model.training)
        received = [n for n in out.graph.nodes if n.op == "placeholder"] if index == 0 \
            else stage_cut.boundaries[index]
        sent = stage_cut.boundaries[index + 1] if index + 1 < len(stages) else [loss]
        built.append(BuiltStage(
            index, len(stages), position, module, groups, p2p_group, stage_to_group_rank,
            tuple(_meta(values[v], v.name) for v in received),
            tuple(_meta(values[v], v.name).reshape(-1) if v is loss
                  else _meta(values[v], v.name) for v in sent),
            pipeline_group=pipeline_group, loss_source_rank=stages[-1].ranks[0],
            loss_dtype=values[loss].dtype))

    # Tied weights read by several chunks: per set of chunks and position, the
    # group of the distinct ranks holding them (none when one rank holds all).
    shared = shared_parameters(stage_cut, out.shards)
    held: list[tuple[list[str], list[int], object]] = []
    for readers in sorted(set(shared.values())):
        names = sorted(n for n, r in shared.items() if r == readers)
        for p in range(meshes[0].size):
            ranks = sorted({stages[k].ranks[p] for k in readers})
            group = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
            local = [i for i, k in enumerate(mine) if k in readers]
            if p == position and local:
                held.append((names, local, group))
    for b in built:
        b.shared = held
        b.first_holder = {name: readers[0] for name, readers in shared.items()}
    return built


def _meta(value, name: str) -> torch.Tensor:
    """A meta tensor of ``value``'s shape, dtype and requires_grad (contiguous:
    stages send contiguous copies)."""
    if not isinstance(value, torch.Tensor):
        raise PipelineError(f"the pipeline sends {name}, a {type(value).__name__}; only "
                            "tensors can cross a stage boundary")
    meta = torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
    if value.requires_grad and (value.is_floating_point() or value.is_complex()):
        meta.requires_grad_(True)
    return meta


def fake_values(out: GeneratedGraph, traced, plan, rank: int, device) -> dict[fx.Node, object]:
    """Every node's value in one microbatch's forward of the whole generated graph,
    on FakeTensors with collectives that only allocate: the shapes, dtypes and
    ``requires_grad`` of what crosses each stage boundary. Draws no random numbers."""
    sim = SimulatedGroups(plan.mesh, rank)
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(out.graph, copies)
    graph.output(None)
    values: dict[fx.Node, object] = {}
    back = {new: old for old, new in copies.items()}
    with torch.random.fork_rng(devices=[]), StorageFaithfulFakeMode(allow_non_fake_inputs=True):
        root = nn.Module()
        for name, value in fake_shards(traced, plan, out.shards, rank, device).items():
            shard = out.shards[name]
            state = traced.parameters.get(name) or traced.buffers.get(name) or \
                traced.constants[name]
            register_state(root, name, value, shard.kind, state.requires_grad)
        for attr, obj in out.attrs.items():
            setattr(root, attr, sim.axis_group(obj.axes) if isinstance(obj, AxisGroup) else obj)
        module = fx.GraphModule(root, graph)

        class _Recorder(fx.Interpreter):
            def run_node(self, n):
                result = super().run_node(n)
                if n in back:
                    values[back[n]] = result
                return result

        _Recorder(module).run(*fake_inputs(traced, plan, rank, device, False))
    return values
