"""``automap.plan``: trace, profile, enumerate strategies, solve the ILP, and
package the result as a Plan. No process group and no weights needed."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import numpy as np
from torch import nn

from automap.checkpoint.chain import chain_of_plan, coarsen, solve_checkpointing
from automap.checkpoint.record import CheckpointPlan
from automap.errors import InfeasibleBudgetError, InvalidMeshError
from automap.planner.plan import EdgePlan, NodePlan, Plan, current_versions, graph_fingerprint
from automap.sharding.layout import layout_path
from automap.sharding.mesh import DeviceMesh
from automap.solve.blocks import detect_blocks
from automap.solve.depth import instance_repeats, multiplicities, reduced_depth
from automap.solve.ilp import solve_ilp
from automap.solve.strategies import build_strategy_table, restrict
from automap.trace.example_inputs import describe_inputs

#: Sustained FLOP/s assumed when neither the caller nor the cluster gives one:
#: an A100's tf32 rate under typical efficiency. Only its ratio to the link
#: speeds matters for a plan.
DEFAULT_FLOPS_PER_S = 100e12

#: The two-stage search's budget ladder: the ILP runs at B * (1 + alpha)^n,
#: n = 0 .. steps - 1, each solution checkpointed within the real budget B.
LADDER_ALPHA, LADDER_STEPS = 0.25, 10


def candidate_meshes(mesh, top_k: int = 3, size: int | None = None):
    """The meshes to plan on and the device FLOP/s if known: a ``DeviceMesh`` or
    a shape is itself; a ``Cluster`` (or a path to its JSON, written by
    ``automap detect`` or by hand) gives its ``top_k`` ranked meshes (of
    ``size`` devices when given)."""
    from automap.cluster.cluster import Cluster

    if isinstance(mesh, (str, os.PathLike)):
        mesh = Cluster.from_json(os.fspath(mesh))
    if isinstance(mesh, Cluster):
        meshes = [m for m in mesh.meshes() if size is None or m.size == size][:top_k]
        if not meshes:
            raise InvalidMeshError(f"the cluster has no mesh of {size} devices")
        return meshes, mesh.sustained_flops_per_s
    if mesh is None:
        raise InvalidMeshError("plan needs a mesh (e.g. automap.DeviceMesh((2, 4))) or a "
                               "cluster (automap.Cluster or a cluster JSON path)")
    return [mesh if isinstance(mesh, DeviceMesh) else DeviceMesh(mesh)], None


def plan_best(traced, profile, meshes, memory_budget_bytes=None, **options) -> Plan:
    """The fastest feasible plan over ``meshes``; when none fits the budget,
    the error names the smallest budget any of them needs."""
    best, errors = None, []
    for mesh in meshes:
        try:
            found = plan_traced(traced, profile, mesh, memory_budget_bytes, **options)
        except InfeasibleBudgetError as err:
            errors.append(err)
            continue
        if best is None or found.predicted_step_s < best.predicted_step_s:
            best = found
    if best is None:
        known = [e for e in errors if e.smallest_feasible_budget_bytes is not None]
        raise min(known, key=lambda e: e.smallest_feasible_budget_bytes) if known else errors[0]
    return best


def plan(
    model: nn.Module,
    example_inputs: Any,
    mesh=None,
    memory_budget_bytes: float | None = None,
    *,
    loss_fn=None,
    optimizer: str = "adamw",
    flops_per_s: float | None = None,
    strict: bool = False,
    time_limit_s: float = 60.0,
    merge_followers: bool = True,
    tie_blocks: bool = True,
    reduce_depth: bool = False,
    strategy_filter=None,
    checkpointing: str = "auto",
    verbose: bool = False,
) -> Plan:
    """Search the intra-op sharding plan of ``model`` on ``mesh`` (a
    ``DeviceMesh``, a shape, or a ``Cluster`` / cluster JSON path whose best few
    meshes are tried) that minimises the estimated step time within ``memory_budget_bytes`` per
    device (None: no limit). Repeated blocks share one decision unless
    ``tie_blocks=False``. ``loss_fn`` maps the model's output to the loss
    (default: ``automap.trace.tracing.default_loss``).

    Within a budget, ``checkpointing="auto"`` runs MAP's two-stage search:
    intra-op plans for the looser budgets B * 1.25^n (n < 10), each made to
    fit B by activation checkpointing (the rotor DP), the fastest kept;
    ``"off"``: the intra-op plan alone must fit; ``"only"``: the fastest
    intra-op plan, checkpointed to fit."""
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import default_loss, trace

    meshes, cluster_flops = candidate_meshes(mesh)
    flops_per_s = flops_per_s or cluster_flops or DEFAULT_FLOPS_PER_S
    t0 = time.perf_counter()
    # Plans cover the whole training step, so the graph ends in the loss.
    with reduced_depth(model) if reduce_depth else contextlib.nullcontext([]) as stacks:
        traced = trace(model, example_inputs, loss_fn=loss_fn or default_loss)
        profile = profile_traced(traced, optimizer)
    t1 = time.perf_counter()
    if verbose:
        print(f"automap: traced and profiled {len(traced.nodes)} nodes in {t1 - t0:.2f} s")
    found = plan_best(traced, profile, meshes, memory_budget_bytes, optimizer=optimizer,
                      flops_per_s=flops_per_s, strict=strict, time_limit_s=time_limit_s,
                      merge_followers=merge_followers, tie_blocks=tie_blocks or bool(stacks),
                      stacks=stacks, strategy_filter=strategy_filter, trace_s=t1 - t0,
                      checkpointing=checkpointing, verbose=verbose)
    found.inputs = describe_inputs(example_inputs)
    return found


def plan_traced(traced, profile, mesh: DeviceMesh, memory_budget_bytes=None, *,
                optimizer="adamw", flops_per_s=DEFAULT_FLOPS_PER_S, strict=False,
                time_limit_s=60.0, merge_followers=True, tie_blocks=True, stacks=(),
                strategy_filter=None, trace_s=0.0, verbose=False, checkpointing="auto",
                ladder_alpha=LADDER_ALPHA, ladder_steps=LADDER_STEPS) -> Plan:
    """``plan`` for an already traced and profiled graph."""
    if checkpointing not in ("auto", "off", "only"):
        raise ValueError(f"checkpointing must be 'auto', 'off' or 'only', not {checkpointing!r}")
    t0 = time.perf_counter()
    table = build_strategy_table(traced, profile, mesh, flops_per_s=flops_per_s,
                                 optimizer=optimizer, strict=strict)
    if strategy_filter is not None:
        restrict(table, strategy_filter)
    t1 = time.perf_counter()
    blocks = detect_blocks(traced) if tie_blocks else []
    node_weight, edge_weight = multiplicities(blocks, list(stacks), list(table.edges()))

    def solve(budget):
        sol = solve_ilp(table, budget, time_limit_s=time_limit_s,
                        merge_followers=merge_followers, blocks=blocks, node_weight=node_weight,
                        edge_weight=edge_weight)
        if verbose:
            print(f"automap: {sum(len(n) for n in table.nodes.values())} strategies in "
                  f"{t1 - t0:.2f} s; ILP (budget {_mib(budget)}) built in {sol.build_s:.2f} s, "
                  f"solved in {sol.solve_s:.2f} s")
        return sol

    def package(sol, checkpoint=None):
        return _package(traced, table, sol, mesh, memory_budget_bytes, node_weight, edge_weight,
                        blocks, stacks, flops_per_s, optimizer, trace_s, t1 - t0, checkpoint)

    if memory_budget_bytes is None or checkpointing == "off":
        return package(solve(memory_budget_bytes))
    return _two_stage(traced, profile, table, memory_budget_bytes, solve, package,
                      checkpointing, ladder_alpha, ladder_steps, verbose,
                      instance_repeats(blocks, list(stacks)) if stacks else None)


def _mib(budget) -> str:
    return "unlimited" if budget is None else f"{budget / 2**20:.1f} MiB"


def _two_stage(traced, profile, table, budget, solve, package, checkpointing, alpha, steps,
               verbose, repeats) -> Plan:
    """MAP's two-stage search (section 5.3): intra-op plans for a ladder of
    looser budgets, each made to fit the real ``budget`` by the rotor
    checkpointing DP; the fastest combination wins. The ladder stops below
    the unconstrained (fastest) intra-op plan's peak, and that plan is always
    tried too; ``checkpointing="only"`` tries it alone."""
    fastest = solve(None)
    fastest_peak = fastest.peak_memory_bytes
    # Rungs at or above the fastest plan's peak give the fastest plan: it is the last.
    rungs = [] if checkpointing == "only" else [
        budget * (1 + alpha) ** n for n in range(steps) if budget * (1 + alpha) ** n < fastest_peak]
    best, least, ilp_error = None, None, None
    for rung in [*rungs, None]:
        try:
            sol = solve(rung) if rung is not None else fastest
        except InfeasibleBudgetError as err:
            ilp_error = err
            continue
        if rung is not None and rung <= budget:
            # The intra-op plan fits alone: a candidate without checkpoints.
            found = package(sol)
            if best is None or found.predicted_step_s < best.predicted_step_s:
                best = found
        chain = coarsen(chain_of_plan(traced, profile, table, sol.choice, repeats))
        try:
            schedule = solve_checkpointing(chain, max(1, int(budget) - chain.persistent_bytes))
        except InfeasibleBudgetError as err:
            need = chain.persistent_bytes + (err.smallest_feasible_budget_bytes or 0)
            least = need if least is None else min(least, need)
            if verbose:
                print(f"automap: rung {_mib(rung)}: no schedule fits; it needs {_mib(need)}")
            continue
        found = package(sol, CheckpointPlan.from_schedule(chain, schedule, rung))
        if verbose:
            print(f"automap: rung {_mib(rung)}: step {found.predicted_step_s * 1e3:.3f} ms "
                  f"(recomputation {schedule.recompute_time_s * 1e3:.3f} ms)")
        if best is None or found.predicted_step_s < best.predicted_step_s:
            best = found
    if best is None:
        if least is None and ilp_error is not None:
            raise ilp_error
        raise InfeasibleBudgetError(
            f"no plan fits a memory budget of {budget:.4g} bytes per device, even with "
            f"activation checkpointing; the smallest feasible budget is about {least:.4g} bytes "
            f"({least / 2**30:.3f} GiB). Raise the budget or use a larger mesh.", least)
    return best


def _package(traced, table, sol, mesh, memory_budget_bytes, node_weight, edge_weight, blocks,
             stacks, flops_per_s, optimizer, trace_s, strategies_s, checkpoint) -> Plan:
    nodes: dict[str, NodePlan] = {}
    compute = comm = 0.0
    for name, node in table.nodes.items():
        c = sol.choice[name]
        order = np.argsort(node.time_s)
        alternatives = [
            {"inputs": list(node.in_specs[i]), "outputs": list(node.out_specs[i]),
             "extra_s": float(node.time_s[i] - node.time_s[c])}
            for i in order if i != c and node.out_specs[i] != node.out_specs[c]
        ][:3]
        partial, scatter, grads = (node.reductions[c] if node.reductions is not None
                                   else ([], None, [[] for _ in node.inputs]))
        nodes[name] = NodePlan(
            name, node.op, node.kind, node.module_path, list(node.in_specs[c]),
            list(node.out_specs[c]), float(node.compute_s[c]), float(node.forward_comm_s[c]),
            float(node.backward_comm_s[c]), alternatives, list(partial), scatter,
            [list(g) for g in grads])
        weight = node_weight.get(name, 1.0)
        compute += weight * float(node.compute_s[c])
        comm += weight * float(node.forward_comm_s[c] + node.backward_comm_s[c])
    edges = []
    for producer, o, consumer, k in table.edges():
        src = nodes[producer].outputs[o]
        dst = nodes[consumer].inputs[k]
        info = table.nodes[producer].outputs[o]
        path = layout_path(mesh, src, dst, info.shape, info.dtype_bytes)
        edges.append(EdgePlan(producer, o, consumer, k, src, dst, list(info.shape),
                              info.dtype_bytes, [repr(s) for s in path.steps], path.cost_s))
        comm += edge_weight.get((producer, o, consumer, k), 1.0) * path.cost_s
    recompute = checkpoint.recompute_s if checkpoint is not None else 0.0
    return Plan(
        mesh=mesh,
        nodes=nodes,
        edges=edges,
        predicted_step_s=compute + comm + recompute,
        predicted_compute_s=compute,
        predicted_communication_s=comm,
        predicted_peak_memory_bytes=(
            sol.peak_memory_bytes if checkpoint is None
            else checkpoint.persistent_bytes + checkpoint.predicted_activation_peak_bytes),
        memory_budget_bytes=memory_budget_bytes,
        memory_binding=sol.memory_binding or recompute > 0,
        graph_fingerprint=graph_fingerprint(traced),
        cost_constants={"flops_per_s": flops_per_s, "optimizer": optimizer},
        solver={"status": sol.status, "gap": sol.gap, "objective_s": sol.objective_s,
                "build_s": sol.build_s, "solve_s": sol.solve_s, "trace_s": trace_s,
                "strategies_s": strategies_s, "binaries": sol.num_binaries,
                "edge_variables": sol.num_edge_variables, "rows": sol.num_rows,
                "block_classes": [[b.container, len(b)] for b in blocks],
                "reduced_depth": [[s.path, s.depth, s.kept] for s in stacks]},
        unsupported_ops={op: len(v) for op, v in table.unsupported_ops.items()},
        versions=current_versions(),
        checkpoint=checkpoint,
    )
