"""``automap.plan``: trace, profile, enumerate strategies, solve the ILP, and
package the result as a Plan. No process group and no weights needed."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from automap.checkpoint.chain import chain_of_plan, choice_of_plan, coarsen, solve_checkpointing
from automap.checkpoint.record import CheckpointPlan
from automap.cluster.device import DeviceProfile, resolve_device_profile
from automap.cluster.workspace import capability_of_names, library_workspace_bytes
from automap.errors import (
    InfeasibleBudgetError,
    InvalidMeshError,
    SolverTimeLimitError,
    TraceError,
)
from automap.generate.microbatch_loss import batch_statistics_node, check_batch_statistics
from automap.generate.simulate import simulate_step
from automap.generate.simulate_pipeline import simulate_stage
from automap.planner.checks import (
    check_budget,
    check_choice,
    check_costs,
    check_flops,
    check_loss_fn,
    check_optimizer,
    check_pipeline,
    check_time_limit,
    check_trainable,
)
from automap.planner.library_workspaces import within_library_workspaces
from automap.planner.microbatch import example_batch, microbatch_counts, microbatch_inputs
from automap.planner.per_microbatch import per_microbatch_table
from automap.planner.pipeline_bound import batch_work_s
from automap.planner.pipeline_search import Microbatched, search_pipeline
from automap.planner.plan import EdgePlan, NodePlan, Plan, current_versions, graph_fingerprint
from automap.planner.plan import format_bytes as _size
from automap.planner.reserve import HEADROOM, reserved
from automap.planner.step_time import shared_gradient_savings, step_time
from automap.progress import stage, verbose_switch
from automap.sharding.layout import layout_path
from automap.sharding.mesh import DeviceMesh
from automap.sharding.spec import ShardingSpec
from automap.solve.blocks import detect_blocks
from automap.solve.depth import instance_repeats, multiplicities, reduced_depth
from automap.solve.ilp import EXACT_COLUMNS, ShardingIlp
from automap.solve.memory import (
    estimate_memory,
    least_held_bytes,
    optimizer_temp_bytes,
    timeline,
)
from automap.solve.strategies import (
    NodeOptions,
    StrategyTable,
    build_strategy_table,
    parameters_whole,
    restrict,
    restricted,
)
from automap.trace.example_inputs import describe_inputs
from automap.trace.optimizer_names import OPTIMIZER_IMPLS, resolve_optimizer_impl

if TYPE_CHECKING:
    from automap.cluster.cluster import Cluster
    from automap.trace.mixed_precision import MixedPrecision

#: The two-stage search's budget ladder: the ILP runs at the budget B and at
#: each rung of the grid P (1 - margin) / (1 + alpha)^n, n = 0 .. steps - 1,
#: above B (P: the fastest plan's peak), each solution checkpointed within B
#: (``_ladder``).
LADDER_ALPHA, LADDER_STEPS = 0.25, 10
#: The grid's top rung is this share under the fastest plan's peak: the
#: near-fastest plans, checkpointed, are often the best (GPT-2 small on (2,2,2)
#: at 0.5x: the plan within 0.99 P, checkpointed, 48.34 ms a step, where the
#: fastest plan checkpointed takes 48.98 ms and the grid's next rung, 0.8 P,
#: plans nothing a dive finds).
LADDER_TOP_MARGIN = 0.01

#: A rung this share or less above one whose LP was feasible but whose dive
#: found no plan is skipped: just above the LP's bound its dive fails too
#: (GPT-2 small on (4,4,4) at 0.5x: the budget's dive failed in 1.7 s and the
#: grid's rung 1.3 % above it in 3.7 s, for no plan).
LADDER_FAILED_DIVE_MARGIN = 0.05

#: Where the budget is under the least-budget LP's bound, the ladder starts
#: this share above the bound (just above it the ILP is infeasible or slow).
LADDER_FLOOR_MARGIN = 1e-3

CHECKPOINTING = ("auto", "off", "only")

#: Branch and bound stops within this share of the optimum (0.5 %: the step
#: time model's own error is larger; 1e-6 took 23 s on GPT-2 small on 2x4
#: where this takes 5 s with the same plan).
MIP_REL_GAP = 5e-3

#: Whether ``plan_traced`` also searches the plans with every parameter whole
#: (a switch for the benches to measure what that search costs and gives).
SEARCH_WHOLE_PARAMETERS = True

log = logging.getLogger(__name__)


def candidate_meshes(mesh, top_k: int = 3, size: int | None = None):
    """The meshes to plan on and what is known of the devices (None, or the
    ``Cluster.device_profile`` fields, ``kind`` and the ``compute_capability``
    their names tell, for the libraries' workspaces): a ``DeviceMesh`` or a
    shape is itself; a ``Cluster`` (or a path to its JSON, written by
    ``automap detect`` or by hand) gives its ``top_k`` ranked meshes (of
    ``size`` devices when given)."""
    from automap.cluster.cluster import Cluster

    if isinstance(mesh, (str, os.PathLike)):
        if not os.path.isfile(mesh):
            raise InvalidMeshError(
                f"no cluster description at {os.fspath(mesh)!r}: a mesh given as a string "
                "is a path to a cluster JSON (automap detect writes one); give a shape such "
                "as (2, 2) or an automap.DeviceMesh instead")
        mesh = Cluster.from_json(os.fspath(mesh))
    if isinstance(mesh, Cluster):
        meshes = [m for m in mesh.meshes() if size is None or m.size == size][:top_k]
        if not meshes:
            raise InvalidMeshError(f"the cluster has no mesh of {size} devices")
        return meshes, {**mesh.device_profile, "kind": mesh.device_kind,
                        "compute_capability": capability_of_names(d.name for d in mesh.devices)}
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
        raise min(known, key=lambda e: e.smallest_feasible_budget_bytes or 0) if known else \
            errors[0]
    return best


@verbose_switch
def plan(
    model: nn.Module,
    example_inputs: Any,
    mesh: DeviceMesh | Sequence[int] | Cluster | str | os.PathLike | None = None,
    memory_budget_bytes: float | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: str | None = "adamw",
    optimizer_impl: str = "auto",
    flops_per_s: float | None = None,
    memory_bandwidth_bytes_per_s: float | None = None,
    op_overhead_s: float | None = None,
    shared_slowdown: float | None = None,
    strict: bool = False,
    time_limit_s: float = 60.0,
    merge_followers: bool = True,
    tie_blocks: bool = True,
    reduce_depth: bool = False,
    strategy_filter: Callable[[StrategyTable, NodeOptions], Any] | None = None,
    checkpointing: str = "auto",
    verify: bool = True,
    exact_columns: float = EXACT_COLUMNS,
    mixed_precision: MixedPrecision | str | None = None,
    reduce_formulation: bool = False,
    pipeline: str | int = "off",
    microbatches: int | str = 1,
    schedule: str = "1f1b",
    verbose: bool = False,
) -> Plan:
    """Search the intra-op sharding plan of ``model`` on ``mesh`` (a
    ``DeviceMesh``, a shape, or a ``Cluster`` / cluster JSON path whose best few
    meshes are tried) that minimises the estimated step time within ``memory_budget_bytes`` per
    device (None: no limit). Repeated blocks share one decision unless
    ``tie_blocks=False``. ``loss_fn`` maps the model's output to the loss
    (default: ``automap.trace.tracing.default_loss``).

    Within a budget, ``checkpointing="auto"`` runs MAP's two-stage search:
    intra-op plans for B and for the looser budgets 0.99 P / 1.25^n (n < 10)
    above it, P the fastest plan's peak, each made to fit B by activation
    checkpointing (the rotor DP), the fastest kept;
    ``"off"``: the intra-op plan alone must fit; ``"only"``: the fastest
    intra-op plan, checkpointed to fit.

    ``exact_columns``: budgeted ILPs of up to this many columns are solved
    exactly, larger ones by LP dives (``math.inf``: always exactly; see
    ``automap.solve.ilp.ShardingIlp``). ``reduce_formulation=True``: the
    ILP with the reduction stage's multi-input followers
    (``automap.solve.reduce``; half the edge variables, but it can lose the
    plans of tight budgets).

    ``optimizer_impl``: the kernels the training loop's optimizer steps with, as
    torch names them (``"for-loop"``, ``"foreach"``, ``"fused"``), which size the
    step's temporaries (Adam's foreach kernels hold one more tensor per parameter
    shard, its for-loop two of the largest shard, fused none); ``"auto"``: torch's
    default for an optimizer built without saying, on the ranks of the mesh's
    backend (foreach on NCCL's GPUs, for-loop on gloo's CPUs). The plan records it
    (``plan.cost_constants["optimizer_impl"]``).

    ``mixed_precision`` (None, ``"bf16"``, ``"fp16"`` or ``automap.MixedPrecision``):
    plan the step as it runs under ``torch.autocast`` in that dtype with float32
    master parameters (the graph carries the casts, so activations are priced at
    the low dtype's bytes and matmuls at its FLOP/s, measured in that dtype unless
    ``flops_per_s`` is given); the plan records it (``plan.mixed_precision``).

    ``pipeline`` (issue 18): ``"off"`` (intra-op only), a number of stages, or
    ``"auto"`` (every stage count that cuts the mesh, 1 included, the fastest
    kept): the mesh's leading axes are cut into equal submeshes, one intra-op
    plan of one of ``microbatches`` microbatches is made on the submesh, and
    the stage boundaries minimise the ``schedule``'s step (``"1f1b"``,
    ``"gpipe"`` or ``"interleaved"``: ``n * v`` chunks, chunk ``j`` on stage
    ``j mod n``, ``v`` chosen by the search) within the budget per stage
    (``automap.planner.pipeline_search``); the plan's ``pipeline`` records the stages.
    ``microbatches="auto"``: the search also chooses the count, per stage count
    ``n`` among the divisors of the batch from ``n`` to ``4 n``
    (``automap.planner.microbatch.microbatch_counts``), each priced on its own
    one-microbatch trace; the record says which (``plan.pipeline.microbatches``).

    ``verify``: run one training step of the generated program on fake tensors
    (``automap.generate.simulate``) and report its peak memory; within a budget,
    plan again until it fits (unless ``reduce_depth``, whose plans are estimates).

    Step times are priced with the device's sustained ``flops_per_s``,
    ``memory_bandwidth_bytes_per_s`` and per-kernel ``op_overhead_s`` (see
    ``automap.cluster.device``): each given one, else the cluster's measured
    profile, else this process's device measured at first use. Measurements
    differ between processes: plan on one rank and send the plan (as
    ``autoparallelize`` does), or give every speed. ``shared_slowdown``: how
    many times faster a rank computes alone than with every rank computing
    (``DeviceProfile.shared_slowdown``; ranks sharing cores; default 1, or what
    ``autoparallelize`` measured): a pipeline's ranks then speed up in its bubbles.

    Progress (each stage, each ILP solve with its objective and gap) is
    logged on the ``automap`` logger; ``verbose=True`` shows it on stderr
    (``automap.progress``)."""
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import default_loss, trace

    memory_budget_bytes = check_budget(memory_budget_bytes)
    optimizer, flops_per_s = check_optimizer(optimizer), check_flops(flops_per_s)
    check_choice(optimizer_impl, "optimizer_impl", OPTIMIZER_IMPLS)
    check_time_limit(time_limit_s)
    check_choice(checkpointing, "checkpointing", CHECKPOINTING)
    meshes, known = candidate_meshes(mesh)
    counts = check_pipeline(pipeline, microbatches, schedule, example_batch(example_inputs),
                            meshes[0])
    check_trainable(model)
    check_loss_fn(loss_fn)
    t0 = time.perf_counter()
    # Plans cover the whole training step, so the graph ends in the loss.
    depth: contextlib.AbstractContextManager[list] = (
        reduced_depth(model) if reduce_depth else contextlib.nullcontext([]))
    with depth as stacks:
        traced = trace(model, example_inputs, loss_fn=loss_fn or default_loss,
                       mixed_precision=mixed_precision)
        profile = profile_traced(traced, optimizer)
    kind = (known or {}).get("kind") or _device_kind(_backend_of(meshes[0]))
    device = resolve_device_profile(
        flops_per_s=flops_per_s, memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s,
        op_overhead_s=op_overhead_s, shared_slowdown=shared_slowdown, known=known,
        kind=kind, dtype=parameter_dtype(traced))
    t1 = time.perf_counter()
    log.debug("traced and profiled %d nodes in %.2f s", len(traced.nodes), t1 - t0)
    options = dict(optimizer=optimizer, optimizer_impl=optimizer_impl, device=device,
                   strict=strict, time_limit_s=time_limit_s,
                   merge_followers=merge_followers, tie_blocks=tie_blocks or bool(stacks),
                   stacks=stacks, strategy_filter=strategy_filter,
                   exact_columns=exact_columns, reduce_formulation=reduce_formulation)

    def search(budget: float | None) -> Plan:
        found: Plan | None = None
        intra_op_error: InfeasibleBudgetError | None = None
        stage_counts = counts
        if 1 in stage_counts:
            try:
                found = plan_best(traced, profile, meshes, budget, trace_s=t1 - t0,
                                  checkpointing=checkpointing, verify=verify, verbose=verbose,
                                  **options)
            except InfeasibleBudgetError as err:
                if stage_counts == [1]:
                    raise
                intra_op_error = err
        if stage_counts != [1] and batch_statistics_node(traced) is not None:
            # Several microbatches would each be normalised by their own statistics.
            if pipeline == "auto":
                stage_counts = [1]
                if found is None and intra_op_error is not None:
                    raise intra_op_error
            else:
                check_batch_statistics(traced, microbatches)
        if stage_counts != [1]:
            work_s = batch_work_s(traced, profile, device, optimizer, stacks)
            found = _plan_pipelined(model, example_inputs, meshes[0], budget, stage_counts,
                                    microbatches, schedule, loss_fn or default_loss,
                                    mixed_precision, reduce_depth, found, intra_op_error,
                                    explicit=pipeline != "auto", verify=verify, work_s=work_s,
                                    recompute=checkpointing != "off", **options)
        assert found is not None  # n = 1 planned, or the pipeline search returned or raised
        return found

    found = within_library_workspaces(search, memory_budget_bytes,
                                      library_workspace_bytes(kind, known))
    found.inputs = describe_inputs(example_inputs)
    return found


def _plan_pipelined(model, example_inputs, mesh, memory_budget_bytes, counts, microbatches,
                    schedule, loss_fn, mixed_precision, reduce_depth, intra_op,
                    intra_op_error, explicit, verify: bool = True, work_s: float = 0.0,
                    recompute: bool = True, **options) -> Plan:
    """The stage search of ``automap.planner.pipeline_search`` on one
    microbatch of ``example_inputs`` (``microbatches="auto"``: one trace per
    count of microbatches searched, ``microbatch.microbatch_counts``); ``verify``:
    the chosen pipeline's stages are simulated (``simulate_pipeline``; not for
    depth-reduced plans, which are not generated); ``work_s``: the whole
    batch's one-device compute, which bounds each (stages, microbatches)
    pair's step from below (``pipeline_bound``); ``recompute``: stages may
    recompute their forward (not under ``checkpointing="off"``)."""
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import trace

    backend = _backend_of(mesh)
    traces: dict[int, Microbatched] = {}
    reduced: list = []

    def prepare(m: int) -> Microbatched:
        if m in traces:
            return traces[m]
        t0 = time.perf_counter()
        depth: contextlib.AbstractContextManager[list] = (
            reduced_depth(model) if reduce_depth else contextlib.nullcontext([]))
        with depth as stacks:
            try:
                traced = trace(model, microbatch_inputs(example_inputs, m), loss_fn=loss_fn,
                               mixed_precision=mixed_precision)
            except TraceError as err:
                # The whole batch traced: what fails on a part of it holds
                # whole-batch tensors outside the inputs.
                raise TraceError(
                    f"tracing one of {m} microbatches (dim 0 of every input split) failed, "
                    f"where the whole batch traced: {err} A pipeline splits the model's "
                    "inputs only; targets or masks that loss_fn or the model hold for the "
                    "whole batch (a closure, an attribute) must be passed as inputs") from err
            profile = profile_traced(traced, options["optimizer"])
        reduced[:] = stacks
        trace_s = time.perf_counter() - t0

        def plan_submesh(submesh: DeviceMesh, budget: float | None):
            tables: list = []
            found = plan_traced(traced, profile, submesh, budget, trace_s=trace_s,
                                checkpointing="off", verify=False, tables=tables,
                                microbatches=m, **options)
            return found, tables[-1]

        def simulate(found: Plan, k: int):
            return simulate_stage(traced, found, k, optimizer=options["optimizer"],
                                  backend=backend, optimizer_impl=resolve_optimizer_impl(
                                      options["optimizer_impl"], backend))

        traces[m] = Microbatched(traced, profile, detect_blocks(traced), plan_submesh,
                                 simulate if verify and not stacks else None)
        return traces[m]

    batch = example_batch(example_inputs)

    def options_of(n: int) -> list[int]:
        if microbatches == "auto":
            assert batch is not None, "check_pipeline refuses 'auto' without a batch"
            return microbatch_counts(batch, n, schedule)
        return [microbatches]

    # ``reduced`` is filled by the first ``prepare``, before the search reads it.
    return search_pipeline(prepare, mesh, memory_budget_bytes, counts, microbatches=options_of,
                           schedule=schedule, optimizer=options["optimizer"], stacks=reduced,
                           intra_op=intra_op, intra_op_error=intra_op_error, explicit=explicit,
                           shared_slowdown=options["device"].shared_slowdown, work_s=work_s,
                           recompute=recompute)


def _backend_of(mesh: DeviceMesh, backend: str | None = None) -> str:
    """The backend a plan on ``mesh`` is simulated and its optimizer resolved for:
    ``backend``, else the mesh's, else NCCL where this process sees a GPU, else gloo."""
    return backend or mesh.backend or ("nccl" if torch.cuda.is_available() else "gloo")


def _device_kind(backend: str) -> str:
    """The devices a plan's backend runs on, whose speeds it is planned with
    where none are given: GPUs under NCCL, CPUs otherwise (a gloo mesh planned
    where a GPU is visible, or an NCCL one where none is)."""
    return "cuda" if backend == "nccl" else "cpu"


def parameter_dtype(traced) -> torch.dtype:
    """The dtype the matmuls compute in (their rate is measured in it): the
    mixed-precision compute dtype, else the dtype most parameter bytes have."""
    setting = getattr(traced, "mixed_precision", None)
    if setting is not None:
        return setting.param_dtype
    bytes_by_dtype: dict[torch.dtype, int] = {}
    for state in traced.parameters.values():
        if state.dtype.is_floating_point:
            nbytes = int(np.prod(state.shape)) * state.dtype.itemsize
            bytes_by_dtype[state.dtype] = bytes_by_dtype.get(state.dtype, 0) + nbytes
    return max(bytes_by_dtype, key=bytes_by_dtype.__getitem__, default=torch.float32)


@verbose_switch
def plan_traced(traced, profile, mesh: DeviceMesh, memory_budget_bytes=None, *,
                optimizer="adamw", optimizer_impl="auto", device: DeviceProfile | None = None,
                flops_per_s=None, memory_bandwidth_bytes_per_s=None, op_overhead_s=None,
                strict=False,
                time_limit_s=60.0, merge_followers=True, tie_blocks=True, stacks=(),
                strategy_filter=None, trace_s=0.0, verbose=False, checkpointing="auto",
                ladder_alpha=LADDER_ALPHA, ladder_steps=LADDER_STEPS, verify=True,
                backend=None, exact_columns=EXACT_COLUMNS, reduce_formulation=False,
                tables: list | None = None, microbatches: int = 1) -> Plan:
    """``plan`` for an already traced and profiled graph, priced on ``device``
    (default: the given speeds, the rest measured on this process's device).
    ``exact_columns``: ILPs up to this many columns are solved exactly under
    a budget (branch and bound), larger ones by LP dives (see
    ``automap.solve.ilp.ShardingIlp``); ``math.inf``: always exactly.
    ``tables``: when given, the strategy table is appended to it (the
    pipeline search prices stages from it). ``microbatches``: the plan runs
    that many microbatches per step (a pipeline stage's submesh plan): the ILP
    prices the parameters' gradient all-reduces and optimizer steps, which run
    once per step, at ``1 / microbatches`` (``per_microbatch.per_microbatch_table``);
    the plan's reported times are one microbatch's, all terms in full.
    ``backend``: the one the plan's collectives run on (default: the mesh's, else
    NCCL where this process sees a GPU, else gloo); ``optimizer_impl`` is
    resolved for its ranks."""
    memory_budget_bytes = check_budget(memory_budget_bytes)
    optimizer = check_optimizer(optimizer)
    check_choice(optimizer_impl, "optimizer_impl", OPTIMIZER_IMPLS)
    backend = _backend_of(mesh, backend)
    optimizer_impl = resolve_optimizer_impl(optimizer_impl, backend)
    flops_per_s = check_flops(flops_per_s)
    check_time_limit(time_limit_s)
    check_choice(checkpointing, "checkpointing", CHECKPOINTING)
    if device is None:
        device = resolve_device_profile(
            flops_per_s=flops_per_s, memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s,
            op_overhead_s=op_overhead_s, kind=_device_kind(backend), dtype=parameter_dtype(traced))
    t0 = time.perf_counter()
    with stage(log, f"built the strategy table on mesh {mesh.shape}",
                   min_s=1.0) as building:
        table = build_strategy_table(traced, profile, mesh, device=device, optimizer=optimizer,
                                     optimizer_impl=optimizer_impl, strict=strict)
        building.result(f"{sum(len(n) for n in table.nodes.values())} strategies of "
                        f"{len(table.nodes)} nodes")
    check_costs(table, mesh, device.flops_per_s)
    if tables is not None:
        tables.append(table)
    if strategy_filter is not None:
        restrict(table, strategy_filter)
    t1 = time.perf_counter()
    blocks = detect_blocks(traced) if tie_blocks else []
    node_weight, edge_weight = multiplicities(blocks, list(stacks), list(table.edges()))
    repeats = instance_repeats(blocks, list(stacks)) if stacks else None
    line = timeline(table)

    # Solutions are memoised per instance (which keeps them alive): each is reported once.
    reported: weakref.WeakKeyDictionary[ShardingIlp, set[int]] = weakref.WeakKeyDictionary()

    def solver(instance: ShardingIlp):
        def solve(budget, find_least=True):
            sol = instance.solve(budget, find_least=find_least)
            seen = reported.setdefault(instance, set())
            if id(sol) not in seen:
                seen.add(id(sol))
                limit = "no memory limit" if budget is None else f"memory limit {_size(budget)}"
                log.info("ILP (%s): %s, step %.4g ms (linear model), gap %.2g %%, peak %s; "
                         "built in %.2f s, solved in %.2f s", limit, sol.status,
                         sol.objective_s * 1e3, sol.gap * 100, _size(sol.peak_memory_bytes),
                         sol.build_s, sol.solve_s)
            return sol
        return solve

    def searcher(options: StrategyTable):
        """The model-based search over ``options`` and its ILP (built once: budgets
        change bounds)."""
        ilp_table = per_microbatch_table(options, microbatches)

        def make_ilp() -> ShardingIlp:
            return ShardingIlp(ilp_table, time_limit_s=time_limit_s, mip_rel_gap=MIP_REL_GAP,
                               merge_followers=merge_followers,
                               blocks=blocks, node_weight=node_weight, edge_weight=edge_weight,
                               optimizer=optimizer, exact_columns=exact_columns,
                               reduce_formulation=reduce_formulation)

        ilp = make_ilp()
        lean: list = []

        def leanest():
            """The memory-minimal intra-op plan, solved on an ILP of its own: plans of
            equal least memory tie, and a solver warm from other budgets may break
            the tie another way, giving another least budget after checkpointing."""
            if not lean:
                instance = make_ilp()
                lean.append(_leanest(solver(instance), instance))
            return lean[0]

        def package(sol, checkpoint=None):
            estimate = estimate_memory(options, sol.choice, line, optimizer, node_weight)
            return _package(traced, profile, options, sol, mesh, memory_budget_bytes,
                            node_weight, edge_weight, blocks, stacks, device, optimizer,
                            trace_s, t1 - t0, checkpoint, estimate)

        def fastest():
            """The unconstrained optimum, packaged anew (simulating changes a plan):
            the same on any instance."""
            return package(solver(ilp)(None))

        def fastest_within(budget, fastest_plan=None):
            """The fastest plan where it fits ``budget`` (else None): by the
            program-order model, or, modelled up to ``MODEL_SLACK`` over it,
            by its simulated step. The budgeted ILP's rows bound the peak from
            above (its buckets per reader), and the model the simulated step,
            so either could refuse the fastest plan where it fits (TinyGPT2 on
            (4,) with every parameter whole, at the fastest plan's own peak:
            modelled 0.25 % over it, and 0.4823 s found where it, 0.4780 s,
            fits)."""
            fastest_plan = fastest_plan or fastest()
            modelled = fastest_plan.predicted_peak_memory_bytes
            if modelled <= budget:
                return fastest_plan
            if verify and modelled <= budget * (1 + MODEL_SLACK):
                checked = simulated(fastest_plan)
                if checked.predicted_peak_memory_bytes <= budget:
                    return checked
            return None

        def search(budget, mode=checkpointing, fresh=False, least=True):
            """The model-based search at ``budget``; ``fresh``: on an ILP of its own, a
            function of the budget alone (where the least budget an error names is
            found, so that a later call at that budget finds the same plan);
            ``least``: where no rung fits, fall back to the plan of least memory
            (and name the least budget), else fail without naming one."""
            instance = make_ilp() if fresh else ilp
            if budget is None:
                return package(solver(instance)(None))
            if mode == "off":
                fastest = fastest_within(budget)
                if fastest is not None:
                    return fastest
                return package(solver(instance)(budget, find_least=least))
            return _two_stage(traced, profile, options, budget, solver(instance), instance,
                              package, mode, ladder_alpha, ladder_steps, repeats,
                              leanest if least else None, asked=memory_budget_bytes)

        return search, ilp, fastest_within, fastest

    search, ilp, _, _ = searcher(table)
    verify = verify and not stacks  # a depth-reduced plan is not generated: no simulation
    steps: dict[tuple, object] = {}  # one simulation per distinct program
    # Without a budget, memory decides nothing: only the plan returned is
    # simulated (GPT-2 small on (2,2,2) simulated the searched plan and the
    # faster one with every parameter whole, 3 s each).
    deferred = memory_budget_bytes is None

    def simulated(found):
        """``found`` with its peak and breakdown from the simulated step."""
        if not verify or deferred or found.solver.get("simulated"):
            return found
        key = _program_key(found)
        if key not in steps:
            with stage(log, "simulated the plan's training step") as simulating:
                steps[key] = simulate_step(traced, found, optimizer=optimizer, backend=backend,
                                           optimizer_impl=optimizer_impl)
                simulating.result(f"peak {_size(steps[key].peak_bytes)}")
        step = steps[key]
        kept = reserved(step, HEADROOM)
        found.solver["modelled_peak_bytes"] = found.predicted_peak_memory_bytes
        found.solver["simulated"] = True
        found.predicted_peak_memory_bytes = float(kept.peak_bytes)
        found.memory_breakdown = kept.breakdown
        found.memory_breakdown_at = step.phase
        found.memory_timeline = kept.timeline
        return found

    def faster_than(found):
        """``simulated`` for a plan predicted faster than ``found``; else
        ``_NotFaster`` (simulating changes a plan's memory, not its time, and
        later rounds of a verified search only tighten)."""
        def simulated_if_faster(other):
            if other.predicted_step_s >= found.predicted_step_s:
                raise _NotFaster
            return simulated(other)
        return simulated_if_faster

    def verified(search_at, check, budget, leanest=True):
        """The plan ``search_at`` finds at ``budget`` (``check``: ``simulated`` or
        ``faster_than``), verified against the simulated step where plans are
        (``leanest``: falling back to the plan of least memory)."""
        if budget is None or not verify:
            return check(search_at(budget))
        return _verified_search(search_at, check, budget, leanest)

    failures: list[InfeasibleBudgetError] = []
    if memory_budget_bytes is not None:
        log.info("searching within a memory budget of %s per device (checkpointing %s)",
                 _size(memory_budget_bytes), checkpointing)
    try:
        found = verified(search, simulated, memory_budget_bytes)
    except InfeasibleBudgetError as err:
        found = None
        failures.append(err)
    if verify and memory_budget_bytes is not None and checkpointing == "auto" and (
            ilp.could_fit(memory_budget_bytes)
            or (found is None and ilp.solves_exactly())):
        # The two-stage search is verified along another path than the ILP
        # alone: keep the faster of both, so auto is never slower than off.
        # (Where the LP relaxation proves that no plain plan fits the budget,
        # only the model's over-estimate could rescue one, the least-memory
        # plan: never faster than a checkpointed plan in our runs, and
        # finding it costs the least budget, a dive and a simulated step.)
        # Where branch and bound solves the ILP, on an instance of its own: the
        # plan "off" finds, whatever the ladder solved before (warm, a solve
        # within MIP_REL_GAP may stop at another plan: 11.45 ms where "off"
        # found 11.41 ms on GPT-2-tiny on (2,)).
        # The least-memory fallback only where branch and bound solves: there
        # it is what "off" returns at budgets the model's least is over but
        # the leanest plan's simulated step fits (the tests' GPT-2 on (2,) at its
        # least: 11.94 ms against 12.48 two-stage), and cheap. Solved by LP
        # dives, the least budget and a fresh instance's dive for a plan that
        # would have to beat the two-stage one cost more than the rest of the
        # search (GPT-2 small on (4,4,4) at 0.5x: 17 s for an 82 ms plan
        # against the 34 ms found).
        # Where the two-stage search found nothing, the plain one may still: its
        # path differs (the tests' MLP on (2,) at the least budget "off" names,
        # 952484 B: the ladder's plans all simulated a few hundred bytes over),
        # and where branch and bound solves, also where the LP relaxation
        # refuses the budget: the model over-estimates the leanest plan, whose
        # simulated step "off" corrects it by (an MLP on (2,2) at 1.70e6 B:
        # "off" planned 1,664,840 B, "auto" found nothing).
        # Its failure is named only where branch and bound solves (below).
        own = ilp.solves_exactly()
        try:
            found = verified(lambda b, fresh=False: search(b, "off", fresh or own, least=own),
                             simulated if found is None else faster_than(found),
                             memory_budget_bytes, leanest=own)
        except InfeasibleBudgetError as err:
            # Where branch and bound solves on a fresh instance, the least it
            # names is a property too (the leanest plain plan's simulated step),
            # and "auto" plans there by this same fallback: without it, "auto"
            # named a larger least than "off" (the sweep's causal-attention
            # model on (2,): 126,751 B against 112,529, where "auto" plans).
            if own and err.smallest_feasible_budget_bytes:
                failures.append(_checkpointing_tried(err))
        except _NotFaster:
            pass
    # The ILP prices every data-parallel gradient all-reduce on its own and
    # unhidden, where the program buckets them beside the backward (one latency
    # per bucket, overlapped): the timeline of a plan with every parameter
    # whole may be faster than the ILP's optimum. Search that family too; where
    # the first search found nothing, for a plan that fits and for the least
    # budget the error names (a smaller one than the first's, where whole
    # parameters make the leaner plan).
    whole = restricted(table, parameters_whole) if SEARCH_WHOLE_PARAMETERS else None
    searched, whole_s = found, None
    # What the family's plans hold at the optimizer step, which no checkpoint
    # frees, bounds their peaks from below (with the model's slack: the
    # simulated step decides): over the budget, none fits; where nothing
    # fitted, at or over the least budget the first search names, none names a
    # smaller one (GPT-2 small on (4,4,4) at 0.3x: 6.5 s of a 47 s error; on
    # (2,2,2) at 0.3x, 0.5 s: whole parameters hold 2.0 GB there, the budget is 1.5).
    whole_floor = math.inf if whole is None else \
        least_held_bytes(whole, node_weight, gradients=True) / (1 + MODEL_SLACK)
    named = [e.smallest_feasible_budget_bytes for e in failures]
    known = [float(b) for b in named if b is not None]
    least_named = min(known) if known and len(known) == len(named) else math.inf
    if whole is not None and (found is None or _shards_parameters(found)) and not (
            (found is not None and memory_budget_bytes is not None
             and whole_floor > memory_budget_bytes)
            or (found is None and whole_floor >= least_named)):
        search_whole, ilp_whole, whole_fastest_within, whole_fastest = searcher(whole)
        # "auto" without a second ladder (within a budget: one more ILP)...
        mode = "off" if checkpointing == "auto" else checkpointing
        plain_fits = False
        best_whole = whole_fastest() if found is not None and \
            memory_budget_bytes is not None else None
        if best_whole is not None and best_whole.predicted_step_s >= found.predicted_step_s:
            # The family's fastest plan is no faster than the one found: a budget
            # only removes plans and checkpointing only adds recomputation.
            log.info("plans with every parameter whole: the fastest (%.3f ms) is not "
                     "faster than %.3f ms; not searched within the budget",
                     best_whole.predicted_step_s * 1e3, found.predicted_step_s * 1e3)
            plain_fits = True
        # The LP relaxation's rows bound the peak from above: it may refuse a
        # budget the fastest whole plan fits. The family's strategies are some
        # of the first's under the same rows: where the first's relaxation
        # proved the budget infeasible (the ILP-alone check above asked), so
        # is theirs (0.9 s, its rows' build and LP, on GPT-2 small (2,2,2)).
        if not plain_fits and (
                found is None or memory_budget_bytes is None
                or whole_fastest_within(memory_budget_bytes, best_whole) is not None
                or (ilp.could_fit(memory_budget_bytes)
                    and ilp_whole.could_fit(memory_budget_bytes))):
            try:
                found = verified(lambda b, fresh=False: search_whole(b, mode, fresh),
                                 simulated if found is None else faster_than(found),
                                 memory_budget_bytes)
                whole_s = found.predicted_step_s
                plain_fits = True
            except InfeasibleBudgetError as err:
                failures.append(err)
            except _NotFaster:
                plain_fits = True
        # ... and, where no whole plan fits without checkpointing, its top rung:
        # the fastest whole plan checkpointed into the budget (data parallelism
        # with recomputation, which the ILP's unhidden per-parameter all-reduces
        # keep off the first ladder on slow links: benches/vs_torch.py's GPT-2
        # within 0.8 of DDP's peak, links of 9.6 ms, planned sharded with one
        # block, 1.58x DDP's step measured, where data parallel with one block
        # ran at 1.04x).
        if not plain_fits and found is not None and checkpointing == "auto" \
                and memory_budget_bytes is not None:
            try:
                # Only the top rung: its least-memory fallback (the least-budget
                # LP of a fresh instance, 22 s of 37 on GPT-2 small (2,2,2) at
                # 0.5x) would be the leaner plans the first search has already
                # searched.
                # The fastest plan alone ("only"): the budget's own rung is the
                # plain search's, and the grid's top rung (0.99 of the fastest
                # plan's peak) is about the fastest plan again; their LP probes
                # cost 0.7 and 1.3 s on GPT-2 small (2,2,2) at 0.5x.
                found = verified(
                    lambda b, fresh=False: search_whole(b, "only", fresh, least=False),
                    faster_than(found), memory_budget_bytes, leanest=False)
                whole_s = found.predicted_step_s
            except (InfeasibleBudgetError, _NotFaster):
                pass
    if found is None:
        raise min(failures, key=lambda e: e.smallest_feasible_budget_bytes or math.inf)
    deferred = False
    found = simulated(found)
    # What the search compared, for explain() and the tests.
    found.solver["compared_step_s"] = {
        "searched": None if searched is None else searched.predicted_step_s,
        "parameters whole": whole_s}
    return found


def _shards_parameters(plan: Plan) -> bool:
    """Whether some parameter of ``plan`` is stored sharded."""
    return any(node.kind == "parameter"
               and not all(ShardingSpec.parse(spec).is_replicated for spec in node.outputs)
               for node in plan.nodes.values())


def _program_key(plan: Plan) -> tuple:
    """What the generated program of ``plan`` depends on: two plans of one key run
    the same step (searches at several budgets often return the same plan)."""
    nodes = tuple((name, tuple(n.inputs), tuple(n.outputs), tuple(n.partial_axes),
                   n.scatter_dim, tuple(tuple(a) for a in n.grad_reduce_axes))
                  for name, n in plan.nodes.items())
    checkpoint = json.dumps(plan.checkpoint.to_dict(), sort_keys=True) if plan.checkpoint \
        else None
    return nodes, checkpoint


class _NotFaster(Exception):
    """The ILP-alone search's plan is no faster than the two-stage one."""


#: The fastest plan is simulated where the program-order model puts it up to
#: this share over a budget (the model bounds the simulated step from above:
#: 0.25 % over on TinyGPT2 with every parameter whole).
MODEL_SLACK = 0.05

#: How often a plan is searched again against a model budget corrected by the
#: simulated step (shrunk where the model fell short, grown where it was over).
VERIFY_ROUNDS = 4

def _verified_search(search, simulated, budget: float, leanest: bool = True) -> Plan:
    """The fastest plan the model-based ``search`` finds whose simulated step
    fits ``budget``. The search runs against a model budget corrected by each
    plan's simulated/modelled ratio; the leanest plan (the model's least,
    simulated) is the fallback, so the smallest feasible budget an error names
    is that plan's simulated peak: a property of the model, mesh and options,
    and a budget at which planning succeeds. ``leanest=False``: no fallback
    (where a faster plan is known, the leanest would have to beat it)."""
    model_budget, fallback = float(budget), None
    for _ in range(VERIFY_ROUNDS):
        try:
            found = simulated(search(model_budget))
        except InfeasibleBudgetError as err:
            if fallback is not None:
                return fallback
            if not leanest:
                raise
            fallback = _leanest_simulated(err, search, simulated, budget)
            ratio = fallback.solver["modelled_peak_bytes"] / \
                fallback.predicted_peak_memory_bytes
            if ratio <= 1.0:
                return fallback  # the model is not over: no search finds more room
            model_budget = max(model_budget, budget * ratio * 0.995)
            log.info("the model over-estimates the leanest plan by %.1f %%; searching "
                     "within a model budget of %s", (ratio - 1) * 100, _size(model_budget))
            continue
        peak = found.predicted_peak_memory_bytes
        if peak <= budget:
            if fallback is None or found.predicted_step_s <= fallback.predicted_step_s:
                return found
            return fallback
        modelled = found.solver["modelled_peak_bytes"]
        model_budget = model_budget * min(modelled / peak, 1.0) * 0.995
        log.info("the simulated step needs %s, over the budget; planning again within a "
                 "model budget of %s", _size(peak), _size(model_budget))
    if fallback is not None:
        return fallback
    try:
        search(1.0)
    except InfeasibleBudgetError as err:
        return _leanest_simulated(err, search, simulated, budget)
    raise AssertionError("a search within 1 byte succeeded")  # pragma: no cover


def _checkpointing_tried(err: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """``err`` of a plain search run by ``checkpointing="auto"``, worded as
    auto's own: checkpointing was tried, so it is not the advice."""
    text = str(err)
    head, sep, rest = text.partition("; the smallest feasible budget")
    if sep and "even with activation checkpointing" not in head:
        head += ", even with activation checkpointing"
    rest = rest.replace(", use a larger mesh, or enable activation checkpointing.",
                        " or use a larger mesh.")
    return InfeasibleBudgetError(head + sep + rest, err.smallest_feasible_budget_bytes)


#: Searches at the least a failed search names, each at the one the last named.
LEANEST_TRIES = 3


def _leanest_simulated(err: InfeasibleBudgetError, search, simulated, budget: float) -> Plan:
    """The plan the search returns at the model's least budget (named by
    ``err``), simulated; an ``InfeasibleBudgetError`` naming its simulated peak
    when that exceeds ``budget``."""
    least = err.smallest_feasible_budget_bytes
    if not least:
        raise err
    for _ in range(LEANEST_TRIES):
        try:
            leanest = simulated(search(float(least) * (1 + 1e-6), fresh=True))
            break
        except InfeasibleBudgetError as again:
            # The model's least is not always reached by the search at it (a
            # ladder rung's plan checkpointed further than its own search
            # does); the least that search names next is tried, so that the
            # least named is one where planning succeeds.
            if not again.smallest_feasible_budget_bytes or \
                    again.smallest_feasible_budget_bytes <= least:
                raise err from None
            err, least = again, again.smallest_feasible_budget_bytes
    else:
        raise err
    peak = leanest.predicted_peak_memory_bytes
    if peak <= budget:
        return leanest
    text = str(err)
    message = text.split("; the smallest feasible budget")[0]
    # The search's own advice: checkpointing is not suggested where it ran.
    advice = text[text.index("Raise the budget"):] if "Raise the budget" in text else ""
    raise InfeasibleBudgetError(
        f"{message}; the smallest feasible budget is about {peak:.4g} bytes "
        f"({_size(peak)}, the leanest plan's simulated step with its reserve). {advice}",
        int(np.ceil(peak))) from None


def _rung(budget) -> str:
    return "the fastest plan" if budget is None else f"ILP rung {_size(budget)}"


def _two_stage(traced, profile, table, budget, solve, instance, package, checkpointing, alpha,
               steps, repeats, leanest_plan, asked: float | None = None) -> Plan:
    """MAP's two-stage search (section 5.3): intra-op plans for a ladder of
    looser budgets, each made to fit the real ``budget`` by the rotor
    checkpointing DP; the fastest combination wins. The unconstrained (fastest)
    intra-op plan is returned as it is when it fits; otherwise it is one more
    rung, and the plain intra-op plan at ``budget`` is a candidate beside the
    checkpointed ones. ``checkpointing="only"``: the fastest plan, checkpointed
    (its least budget is that plan's, checkpointed as far as it goes).
    The rungs are ``_ladder``'s: a grid fixed by the fastest plan's peak, not
    by the budget. When nothing fits, the error names the least budget of the
    plans climbed and the memory-minimal plan, each checkpointed as far as it
    goes: a property of the model, the mesh (its links too: the rungs' plans are
    the fastest within them) and the options, not of the budget asked for.
    ``leanest_plan`` None: neither that fallback nor the rung above the LP's
    least bound (both cost the least-budget LP); the error then names no least.
    ``asked``: the budget the user asked for, where ``budget`` is a verify
    round's model budget under it: one more rung, whose plan (the plain one of
    the first round, which the simulated step found just over) checkpointed
    into ``budget`` is a candidate too. Without it the grid's rungs could all
    be too far above (T5 at 0.5x on (2,): its plain plan 0.6 % over in the
    simulated step, the next rung 20 % above the budget, and the search fell
    back to the leanest plan, 4.38 ms a step). It is not a climbed plan: the
    least an error names stays the grid's."""
    fastest = solve(None)
    if fastest.peak_memory_bytes <= budget:
        return package(fastest)
    could_fit = instance.could_fit
    rungs = [] if checkpointing == "only" else _ladder(budget, fastest.peak_memory_bytes,
                                                       alpha, steps)
    asked_rung = asked if (rungs and asked is not None and budget < asked
                           < fastest.peak_memory_bytes and asked not in rungs) else None
    if asked_rung is not None:
        rungs = sorted([*rungs, asked_rung])
    best = None
    timed_out: list[SolverTimeLimitError] = []
    climbed = [fastest]  # the intra-op plans checkpointed

    def consider(found):
        nonlocal best
        if best is None or found.predicted_step_s < best.predicted_step_s:
            best = found

    failed_dives: list[float] = []

    def climb(rung):
        if rung is not None and not could_fit(rung):
            return  # the LP relaxation proves it: no need for the least budget
        if rung is not None and any(
                failed < rung <= failed * (1 + LADDER_FAILED_DIVE_MARGIN)
                for failed in failed_dives):
            log.info("%s: just above a rung whose dive found no plan; skipped", _rung(rung))
            return
        try:
            sol = solve(rung, find_least=False) if rung is not None else fastest
        except InfeasibleBudgetError:
            if not instance.solves_exactly():
                # The LP fits, so its dive found no plan (nor did any solve
                # before); branch and bound's proof says nothing of the next rung.
                failed_dives.append(rung)
            return
        except SolverTimeLimitError as err:
            # One rung the solver could not decide: the others still plan (it
            # is reported only where nothing else fits).
            log.warning("%s: %s; skipped", _rung(rung), err)
            timed_out.append(err)
            return
        if sol.peak_memory_bytes <= budget:
            consider(package(sol))  # fits without checkpoints
            return
        if rung != asked_rung:
            climbed.append(sol)
        schedule, chain = _checkpoint(traced, profile, table, sol, budget, repeats)
        if schedule is None:
            log.info("%s: no checkpoint schedule fits %s", _rung(rung), _size(budget))
            return
        found = package(sol, CheckpointPlan.from_schedule(chain, schedule, rung))
        log.info("%s, checkpointed within %s: step %.3f ms (recomputation %.3f ms)",
                 _rung(rung), _size(budget), found.predicted_step_s * 1e3,
                 schedule.recompute_time_s * 1e3)
        consider(found)

    for rung in [*rungs[_lowest_fitting(rungs, could_fit):], None]:
        climb(rung)
    if best is None and rungs and leanest_plan is not None:
        # Rungs under the least-budget LP's bound plan nothing: where none of
        # the others fits either, one more just above the bound (GPT-3 76B on
        # 2x8 with slow links at 80 GiB: the rungs under its plain least of
        # about 333 GiB were skipped and the one at 381 GiB could not be
        # checkpointed to fit; this one can, 18.0 s a step where the leanest
        # plan alone takes 21.6 s).
        floor = instance.least_bound_bytes() * (1 + LADDER_FLOOR_MARGIN)
        if budget < floor < fastest.peak_memory_bytes and floor not in rungs:
            climb(floor)
    if best is None and checkpointing == "only":
        least = _checkpointed_least(traced, profile, table, fastest, repeats)
        raise InfeasibleBudgetError(
            f"the fastest plan, checkpointed, does not fit a memory budget of {budget:.4g} "
            f"bytes per device; the smallest feasible budget is about {least:.4g} bytes "
            f"({_size(least)}). Raise the budget, or use checkpointing='auto'.", int(least))
    if best is None and leanest_plan is None:
        raise InfeasibleBudgetError(
            f"no rung of the ladder fits a memory budget of {budget:.4g} bytes per device",
            None)
    if best is None:
        # The memory-minimal intra-op plans, checkpointed, fit where no rung does.
        leanest, plain_least = leanest_plan()
        if leanest is not None and leanest.peak_memory_bytes <= budget:
            consider(package(leanest))
        elif leanest is not None:
            schedule, chain = _checkpoint(traced, profile, table, leanest, budget, repeats)
            if schedule is not None:
                consider(package(leanest, CheckpointPlan.from_schedule(chain, schedule, None)))
    if best is None and timed_out:
        raise timed_out[0]  # not proved infeasible: the solver ran out of time
    if best is None:
        # Nothing fitting, the budget is under every feasible rung of the grid:
        # the least is that of every plan the ladder checkpointed and of the
        # plan of least memory, each checkpointed as far as it goes, the same
        # from every budget under it; at that budget the ladder climbs the plan
        # that reaches it (or falls back to the plan of least memory).
        least = min([_checkpointed_least(traced, profile, table, sol, repeats)
                     for sol in [*climbed, *([leanest] if leanest is not None else [])]]
                    + [plain_least])
        raise InfeasibleBudgetError(
            f"no plan fits a memory budget of {budget:.4g} bytes per device, even with "
            f"activation checkpointing; the smallest feasible budget is about {least:.4g} bytes "
            f"({_size(least)}). Raise the budget or use a larger mesh.", int(least))
    return best


def _ladder(budget: float, top: float, alpha: float, steps: int) -> list[float]:
    """The ILP budgets the two-stage search climbs within ``budget``, ascending:
    the budget itself and the rungs of the fixed grid
    ``top * (1 - LADDER_TOP_MARGIN) / (1 + alpha)^n`` (n = 0 .. ``steps`` - 1;
    ``top``: the fastest plan's peak) above it. MAP's ladder
    ``budget * (1 + alpha)^n`` moves with the budget, and with it the intra-op
    plans checkpointed: a budget could plan where a larger one did not
    (benches/trust.py's MLP on (4,): a plan of 10.06 MiB within 10.62 MiB, and
    11.22 MiB refused). On a fixed grid every budget climbs the rungs above
    it, so a budget that plans, plans at every larger one, and one under every
    feasible rung climbs them all: the least it names is theirs."""
    grid = (top * (1 - LADDER_TOP_MARGIN) / (1 + alpha) ** n for n in range(steps))
    return [budget, *sorted(g for g in grid if g > budget)]


def _lowest_fitting(rungs: list[float], could_fit) -> int:
    """The index of the lowest of the ascending ``rungs`` the LP relaxation may
    fit (``len(rungs)``: none). Its feasibility is monotone in the budget, so
    bisection decides the rungs in about log2(n) relaxations, without the
    least-budget LP (GPT-2 small on (2,2,2): 12-34 s, where most rungs are
    decided in 0.4-4 s); ``could_fit`` keeps what each proved, so the
    climb's own calls for these rungs cost nothing."""
    low, high = 0, len(rungs)  # rungs[:low] cannot fit; rungs[high:] may
    while low < high:
        middle = (low + high) // 2
        if could_fit(rungs[middle]):
            high = middle
        else:
            low = middle + 1
    return low


def _leanest(solve, instance: ShardingIlp):
    """An intra-op plan of least memory and its modelled peak ((None, inf)
    when the model finds none): the one ``instance`` found the least with,
    ties broken by compute alone, not by the links (the least an error names
    is its, checkpointed: the same on slow links and fast ones). Else, where
    the instance keeps none, the fastest plan at the least budget."""
    try:
        solve(1.0)
    except InfeasibleBudgetError as err:
        least = err.smallest_feasible_budget_bytes
        if least:
            lean = instance.least_memory_plan()
            if lean is not None:
                return lean, float(least)
            try:
                return solve(float(least) * (1 + 1e-6)), float(least)
            except InfeasibleBudgetError:
                pass
    return None, float("inf")


def _checkpoint(traced, profile, table, sol, budget, repeats):
    """The rotor schedule of ``sol``'s chain within ``budget`` (None when none fits,
    the optimizer step included), and the chain."""
    chain = coarsen(chain_of_plan(traced, profile, table, sol.choice, repeats))
    if _optimizer_step_bytes(chain, table) > budget:
        return None, chain
    try:
        return solve_checkpointing(chain, max(1, int(budget) - chain.persistent_bytes)), chain
    except InfeasibleBudgetError:
        return None, chain


def _optimizer_step_bytes(chain, table) -> float:
    grads = sum(chain.param_grad_bytes)
    return chain.persistent_bytes + grads + optimizer_temp_bytes(
        table.optimizer, table.optimizer_impl, chain.param_shard_bytes, grads)


def _checkpointed_least(traced, profile, table, sol, repeats) -> float:
    chain = coarsen(chain_of_plan(traced, profile, table, sol.choice, repeats))
    try:
        schedule = solve_checkpointing(chain, 1)
        activations = schedule.peak_memory_bytes
    except InfeasibleBudgetError as err:
        activations = err.smallest_feasible_budget_bytes or 0
    return max(chain.persistent_bytes + activations, _optimizer_step_bytes(chain, table))


def _package(traced, profile, table, sol, mesh, memory_budget_bytes, node_weight,
             edge_weight, blocks, stacks, device, optimizer, trace_s, strategies_s, checkpoint,
             estimate) -> Plan:
    nodes: dict[str, NodePlan] = {}
    compute = comm = 0.0
    shared_s = shared_gradient_savings(table, sol.choice)
    for name, node in table.nodes.items():
        c = sol.choice[name]
        order = np.argsort(node.time_s)
        seen = {tuple(node.out_specs[c])}  # the cheapest strategy of each other output
        alternatives: list[dict[str, Any]] = []
        for i in order:
            if len(alternatives) == 3:
                break  # not on through every strategy (0.45 s of three packages did)
            if tuple(node.out_specs[i]) not in seen:
                seen.add(tuple(node.out_specs[i]))
                alternatives.append({"inputs": list(node.in_specs[i]),
                                     "outputs": list(node.out_specs[i]),
                                     "extra_s": float(node.time_s[i] - node.time_s[c])})
        partial, scatter, grads = (node.reductions[c] if node.reductions is not None
                                   else ([], None, [[] for _ in node.inputs]))
        nodes[name] = NodePlan(
            name, node.op, node.kind, node.module_path, list(node.in_specs[c]),
            list(node.out_specs[c]), float(node.compute_s[c]), float(node.forward_comm_s[c]),
            float(node.backward_comm_s[c]) - shared_s.get(name, 0.0), alternatives,
            list(partial), scatter, [list(g) for g in grads])
        weight = node_weight.get(name, 1.0)
        compute += weight * float(node.compute_s[c])
        comm += weight * (nodes[name].forward_comm_s + nodes[name].backward_comm_s)
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
    peak, breakdown, at = estimate.peak_bytes, dict(estimate.breakdown), estimate.at
    if checkpoint is not None:
        activations = checkpoint.predicted_activation_peak_bytes
        peak = max(checkpoint.persistent_bytes + activations, estimate.optimizer_step_bytes)
        breakdown = {"parameters and optimizer state, inputs": checkpoint.persistent_bytes,
                     "activations, gradients and temporaries (checkpointed)": activations}
        at = "the checkpointed step"
    timeline = step_time(profile, table, sol.choice, node_weight, edge_weight, checkpoint)
    return Plan(
        mesh=mesh,
        nodes=nodes,
        edges=edges,
        predicted_step_s=timeline.step_s,
        predicted_compute_s=compute,
        predicted_communication_s=comm,
        predicted_peak_memory_bytes=peak,
        memory_breakdown=breakdown,
        memory_breakdown_at=at,
        memory_budget_bytes=memory_budget_bytes,
        memory_binding=sol.memory_binding or recompute > 0,
        graph_fingerprint=graph_fingerprint(traced),
        mixed_precision=getattr(traced, "mixed_precision", None),
        cost_constants={**device.to_dict(), "optimizer": optimizer,
                        "optimizer_impl": table.optimizer_impl},
        solver={"status": sol.status, "gap": sol.gap, "objective_s": sol.objective_s,
                "build_s": sol.build_s, "solve_s": sol.solve_s, "trace_s": trace_s,
                "strategies_s": strategies_s, "binaries": sol.num_binaries,
                "edge_variables": sol.num_edge_variables, "rows": sol.num_rows,
                "block_classes": [[b.container, len(b)] for b in blocks],
                "reduced_depth": [[s.path, s.depth, s.kept] for s in stacks]},
        unsupported_ops={op: len(v) for op, v in table.unsupported_ops.items()},
        versions=current_versions(),
        checkpoint=checkpoint,
        step_time=timeline.to_dict(),
    )


def reprice(traced, profile, plan: Plan, device: DeviceProfile, optimizer: str = "adamw",
            mesh: DeviceMesh | None = None):
    """The ``StepTime`` of ``plan`` (made for ``traced``) priced on ``device``
    and ``mesh`` (default: the plan's; same shape): the same strategies under
    other speeds."""
    table = build_strategy_table(traced, profile, mesh or plan.mesh, device=device,
                                 optimizer=optimizer)
    return step_time(profile, table, choice_of_plan(table, plan), checkpoint=plan.checkpoint)
