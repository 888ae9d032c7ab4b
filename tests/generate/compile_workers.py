"""Gloo workers of the torch.compile tests: a generated module compiled with
``torch.compile`` trains with eager's losses, and Dynamo's graph breaks are counted."""

from __future__ import annotations

import copy

import torch

import automap
from automap.api import apply
from forced_plans import forced_plan
from generate_workers import FORCED
from serial import build

STEPS = 3
#: Megatron's MLP (fc1 by columns, fc2 by rows: a partial sum all-reduced in the
#: graph, gradients all-reduced in the backward), data parallelism (the batch
#: split, gradients all-reduced in buckets outside the graph), and sharded data
#: parallelism (parameters gathered in the graph, gradients reduce-scattered).
PLANS = {"megatron": lambda mesh: {"params": {r"fc1\.weight": "S0R", r"fc1\.bias": "S0",
                                              r"fc2\.weight": "RS0"}},
         "data_parallel": lambda mesh: {"params": {}, "inputs": {"args_0": "S0R"}},
         "fsdp": FORCED["fsdp"]}


def _train(module, inputs) -> list[float]:
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for _ in range(STEPS):
        loss = module(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def compiled_against_eager(rank: int, world: int, plan_name: str, backend: str) -> dict:
    import torch._dynamo

    model, inputs, loss_fn = build("mlp")
    mesh = automap.DeviceMesh((world,))
    _, plan = forced_plan(model, inputs, loss_fn, mesh, **PLANS[plan_name](mesh))
    eager = apply(plan, copy.deepcopy(model), inputs, loss_fn=loss_fn)
    compiled_module = apply(plan, copy.deepcopy(model), inputs, loss_fn=loss_fn)
    explained = torch._dynamo.explain(compiled_module)(*inputs)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_module, backend=backend)
    return {"eager": _train(eager, inputs), "compiled": _train(compiled, inputs),
            "graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
            "reasons": [str(r.reason).splitlines()[0] for r in explained.break_reasons],
            "collectives_in_graph": sum(
                str(n.target).startswith("automap.") for g in explained.graphs
                for n in g.graph.nodes if n.op == "call_function")}
