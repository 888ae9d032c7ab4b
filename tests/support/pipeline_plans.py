"""Pipelined plans for the runtime's tests (issue 18), made by hand: one intra-op
plan for ONE microbatch on the stage submesh (the solver's, or a forced one),
cut into stages at nodes chosen by module, as ``automap.planner.pipeline_record``
describes. The planner's own stage search lives elsewhere; these plans exercise
the runtime on cuts the tests choose."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from automap import DeviceMesh
from automap.planner.pipeline_record import PipelineRecord, StageRecord
from automap.planner.plan import Plan
from automap.planner.validate import content_fingerprint


class DeepMLP(nn.Module):
    """Wide layers, small activations: gradients weigh more than activations."""

    def __init__(self, width: int = 1024, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def mean_square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def forged_pipeline(plan: Plan, edit) -> dict:
    """``plan``'s JSON with ``edit`` applied to its pipeline record and the content
    fingerprint made to match: only validation can refuse it."""
    data = copy.deepcopy(plan.to_dict())
    edit(data["pipeline"])
    data["content_fingerprint"] = content_fingerprint(data)
    return data


class PipeMLP(nn.Module):
    """An MLP of four linears that computes its own loss from the targets (a
    pipelined loss must be part of the graph: the targets travel with the batch)."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        h = F.gelu(self.fc3(h))
        return F.cross_entropy(self.head(h), y)


def computed_nodes(traced) -> list[str]:
    return [n.name for n in traced.graph.nodes if n.op == "call_function"]


def first_node_in(traced, module_prefix: str) -> str:
    """The first computed node of the module at ``module_prefix`` (or below it)."""
    for name in computed_nodes(traced):
        path = traced.nodes[name].module_path
        if path == module_prefix or path.startswith(module_prefix + "."):
            return name
    raise KeyError(module_prefix)


def pipelined(plan: Plan, traced, starts: list[str], *, world: int, microbatches: int,
              schedule: str, virtual: int = 1) -> Plan:
    """``plan`` (made on a submesh of ``world // len(stages)`` ranks for one
    microbatch of ``traced``) cut into stages that begin at the computed nodes
    ``starts`` (stage 0's first node is the graph's first), on a 1-D world;
    ``virtual`` chunks per rank (interleaved: chunk j on submesh j mod n)."""
    nodes = computed_nodes(traced)
    firsts = [nodes[0], *starts]
    positions = [nodes.index(f) for f in firsts] + [len(nodes)]
    chunks = len(firsts)
    n = chunks // virtual
    per = world // n
    stages = tuple(
        StageRecord(index=k, first_node=nodes[positions[k]], last_node=nodes[positions[k + 1] - 1],
                    ranks=tuple(range(k % n * per, (k % n + 1) * per)), predicted_forward_s=0.0,
                    predicted_backward_s=0.0, predicted_peak_memory_bytes=0.0)
        for k in range(chunks))
    mesh = DeviceMesh((world,), alpha_s=plan.mesh.alpha_s[0],
                      bandwidth_bytes_per_s=plan.mesh.bandwidth_bytes_per_s[0])
    record = PipelineRecord(mesh=mesh.to_dict(), submesh_shape=tuple(plan.mesh.shape),
                            microbatches=microbatches, schedule=schedule, stages=stages,
                            predicted_step_s=0.0, send_s=(0.0,) * (chunks - 1),
                            virtual_stages=virtual)
    out = Plan.from_dict(plan.to_dict())
    out.pipeline = record
    return out


def build_case(name: str, microbatches: int):
    """(model, args, kwargs, one microbatch's example inputs) in float64, seeded;
    the batch is 8 samples for the MLP, 4 sequences for GPT-2."""
    import model_zoo
    from serial import no_dropout

    torch.manual_seed(0)
    if name == "mlp":
        model = PipeMLP().double()
        x = torch.randn(8, 16, dtype=torch.float64)
        y = torch.randint(0, 10, (8,))
        return model, (x, y), {}, (x[:8 // microbatches], y[:8 // microbatches])
    model, inputs, _ = model_zoo.gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = no_dropout(model).double()
    ids = inputs["input_ids"]
    micro = {"input_ids": ids[:len(ids) // microbatches],
             "labels": ids[:len(ids) // microbatches].clone()}
    return model, (), {"input_ids": ids, "labels": ids.clone()}, micro
