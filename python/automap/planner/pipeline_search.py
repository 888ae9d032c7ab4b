"""The stage search (issue 18): for each stage count ``n``, one intra-op plan
of one microbatch on the submesh shape (``pipeline_mesh``), the chain of
units it prices (``pipeline_chain``), the best stage boundaries
(``pipeline_partition``); the fastest over ``n``, beside the intra-op plan of
the whole batch on the whole mesh (``n = 1``), is the plan.

The submesh plan is made without checkpointing, within ``n`` times the
budget (it holds the whole model, a stage about ``1/n`` of it); while the
stages fit only by recomputing (a stage keeps up to ``n`` microbatches in
flight), leaner plans are tried (``leaner_budgets``). The budget binds per
stage, on the stage's own parameters and in-flight activations, and the
partition enforces it. Planning cost: one to three intra-op plans per
(``n``, ``M``) pair searched, never one per boundary choice; the pairs are
searched best-first by a lower bound on their step (``pipeline_bound``), and
those whose bound is no better than a pipeline already found are not
searched (the plan is the exhaustive search's).

Verification (``simulate`` given): the chosen pipeline's stages are simulated
(``automap.generate.simulate_pipeline``: the stage's generated module on fake
tensors under the schedule's order of microbatches), and each stage's peak is
the simulated one. Where a stage exceeds the budget, the partition is searched
again with per-stage budgets corrected by simulated/modelled (at most
``VERIFY_ROUNDS`` rounds; only the chosen plan and its retries are simulated);
if that fails the next stage count is tried, and when none verifies,
``InfeasibleBudgetError`` names a least budget found independently of the
budget asked (``_least_named``)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from automap.checkpoint.chain import choice_of_plan
from automap.errors import InfeasibleBudgetError, InvalidPipelineError, SolverTimeLimitError
from automap.planner.pipeline_bound import step_lower_bound_s
from automap.planner.pipeline_chain import Chain, build_chain, cut_positions
from automap.planner.pipeline_merge import merged_plan, stage_of_nodes
from automap.planner.pipeline_mesh import cut_mesh
from automap.planner.pipeline_partition import (
    Partition,
    best_mixed_split,
    best_partition,
    bounds_partition,
    least_budget,
    price_bounds,
)
from automap.planner.pipeline_record import PipelineRecord, StageRecord
from automap.planner.plan import Plan
from automap.planner.reserve import STAGE_HEADROOM, reserved
from automap.progress import stage as progress_stage
from automap.solve.depth import instance_repeats

log = logging.getLogger(__name__)


def unit_count(one: Microbatched, stacks) -> int:
    """How many units the chain of ``one``'s trace has that read a trainable
    parameter (the most stages it can take: a stage without one is none, see
    ``pipeline_partition._stage_matrices``)."""
    traced, blocks = one.traced, one.blocks
    computed = [n for n in traced.graph.nodes if n.op == "call_function"]
    order = [n.name for n in computed]
    cuts = cut_positions(traced, order, blocks)
    repeats = instance_repeats(blocks, list(stacks)) if stacks else {}

    def trains(node) -> bool:
        return any((state := traced.state_of(a.name)) is not None and state.kind == "parameter"
                   and state.requires_grad for a in node.all_input_nodes)

    count = 0
    for first, end in zip([0, *cuts], [*cuts, len(order)]):
        if any(trains(computed[i]) for i in range(first, end)):
            count += max((repeats.get(order[i], 1) for i in range(first, end)), default=1)
    return count


#: Rounds of re-partitioning against corrected per-stage budgets after the
#: simulated step finds a stage over the budget (as ``search.VERIFY_ROUNDS``).
VERIFY_ROUNDS = 4

#: The most chunks per rank the interleaved search tries (each more halves
#: the fill and drain again but adds a send per chunk and microbatch).
MAX_VIRTUAL = 4


def virtual_counts(schedule: str, n: int, units: int) -> list[int]:
    """Chunks per rank to try: 1 unless interleaved; interleaved, 2 ..
    ``MAX_VIRTUAL`` as far as the chain's ``units`` give every chunk one."""
    if schedule != "interleaved":
        return [1]
    return list(range(2, min(MAX_VIRTUAL, units // n) + 1))


#: Shares of the first submesh plan's activations that leaner plans keep.
LEANER_ACTIVATIONS = (0.5, 0.25)


def leaner_budgets(found: Plan) -> list[float]:
    """Budgets for submesh plans keeping a share of ``found``'s activations
    (``LEANER_ACTIVATIONS``): its state is the whole model's, so a budget alone
    scaled down would cut nothing but activations anyway."""
    activations = found.memory_breakdown.get("activations", 0.0)
    return [found.predicted_peak_memory_bytes - activations * (1 - share)
            for share in LEANER_ACTIVATIONS if activations > 0]


@dataclass
class Microbatched:
    """The model traced for one microbatch of a count ``M`` and what the stage
    search needs of that trace: ``plan_submesh(submesh, budget)`` returns the
    submesh's intra-op plan within ``budget`` and its strategy table;
    ``simulate(plan, k)`` the simulated step of rank ``k`` (None: no
    verification)."""

    traced: object
    profile: object
    blocks: list
    plan_submesh: Callable
    simulate: Callable | None = None


#: The two kinds of the best-first search's heap entries (``search_pipeline``).
_SEARCH, _VERIFY = 0, 1


def search_pipeline(prepare: Callable[[int], Microbatched], mesh, memory_budget_bytes,
                    counts: list[int], *, microbatches: Callable[[int], list[int]],
                    schedule: str, optimizer, stacks, intra_op: Plan | None,
                    intra_op_error: InfeasibleBudgetError | None = None,
                    explicit: bool = False,
                    shared_slowdown: float = 1.0, work_s: float = 0.0,
                    name_least: bool = True, recompute: bool = True) -> Plan:
    """The fastest plan over the stage ``counts`` and, for each count ``n``,
    the microbatch counts ``microbatches(n)`` (one for an explicit
    ``microbatches=M``; several for ``"auto"``, each priced with its own
    one-microbatch trace, ``prepare(M)``) (see the module docstring).
    ``intra_op``: the whole batch's plan on the whole mesh (None: not searched
    or infeasible, ``intra_op_error`` says why). ``explicit``: the caller asked
    for exactly these counts (too few units is then an
    ``InvalidPipelineError``). ``shared_slowdown``: the device profile's
    (``pipeline_partition.schedule_step_s``).

    ``work_s``: the whole batch's one-device compute (``pipeline_bound``; 0:
    no bound). ``recompute``: stages may recompute their forward to fit
    (``checkpointing`` other than ``"off"``). The (n, M) pairs are searched
    best-first: in the order of their lower bounds, a pair's found pipeline
    verified once no unsearched pair's bound is below its step, so the
    pipelines are verified in the order of their steps, as if every pair had
    been searched; the pairs still unsearched when a plan is returned are
    recorded with their bound (``pruned``), not searched.

    Where nothing fits the budget, the least budget named is a property of
    the model, mesh and options, not of the budget asked (``_least_named``;
    ``name_least=False``: the least simulated worst-stage peak this search
    saw, or None)."""
    t0 = time.perf_counter()
    tried = [n for n in counts if n > 1]
    least = 2 if schedule == "interleaved" else 1  # chunks per stage
    # Heap entries: (key, SEARCH, n, M) to search, key its lower bound;
    # (step, VERIFY, n, M, found) to verify. On equal keys a search goes first.
    heap: list[tuple] = []
    virtual = MAX_VIRTUAL if schedule == "interleaved" else 1  # the least bound
    for n in tried:
        stages = cut_mesh(mesh, n)
        heap += [(step_lower_bound_s(work_s, stages, m, virtual, shared_slowdown), _SEARCH, n, m)
                 for m in microbatches(n)]
    heapq.heapify(heap)
    units = unit_count(prepare(heap[0][3]), stacks) if heap else 0
    if explicit and heap and tried[0] * least > units:
        raise InvalidPipelineError(
            f"pipeline={tried[0]} stages but the model splits into at most {units} "
            + ("stages" if least == 1 else f"chunks, and interleaved 1F1B needs at least "
               f"{least} per stage ({least * tried[0]})")
            + " (its layers and the parts before and after them that hold a trainable "
            "parameter)")
    tried = [n for n in tried if n * least <= units]
    heap = [entry for entry in heap if entry[2] in tried]
    heapq.heapify(heap)
    candidates: list[dict] = []
    found_any = False
    timeouts: list[SolverTimeLimitError] = []
    intra_s = intra_op.predicted_step_s if intra_op is not None else None
    least_peak: float | None = None  # the least simulated worst-stage peak seen
    searched: list[tuple[int, int]] = []  # (n, M) pairs
    order = itertools.count()  # ties between verify entries never compare plans
    while heap:
        entry = heapq.heappop(heap)
        key, kind, n, m = entry[:4]
        stages = cut_mesh(mesh, n)
        if kind == _SEARCH:
            searched.append((n, m))
            one = prepare(m)
            start = time.perf_counter()
            found, sub_plan, chain = _search_count(one, stages, n, m, units, schedule,
                                                   memory_budget_bytes, optimizer, stacks,
                                                   shared_slowdown, timeouts, recompute)
            seconds = time.perf_counter() - start
            candidates.append(_candidate(stages, m, key, found, seconds))
            log.info("%d stages of %s, %d microbatches: %s (%.2f s)", n, stages.submesh_shape,
                     m, "no split fits" if found is None else
                     f"step {found.step_s * 1e3:.3f} ms", seconds)
            if found is not None and sub_plan is not None:
                found_any = True
                heapq.heappush(heap, (found.step_s, _VERIFY, n, m, next(order),
                                      (sub_plan, found, chain, False)))
            continue
        sub_plan, partition, chain, leaner = entry[5]
        if intra_s is not None and intra_s <= partition.step_s and not explicit:
            break
        plan, seen = _verified(sub_plan, partition, stages, chain, m, schedule,
                               memory_budget_bytes, optimizer, intra_s, candidates, t0,
                               prepare(m).simulate, shared_slowdown, recompute)
        if seen is not None:
            least_peak = seen if least_peak is None else min(least_peak, seen)
        if plan is not None and not (intra_s is not None and intra_s <= plan.predicted_step_s
                                     and not explicit):
            _record_pruned(heap, mesh, candidates)
            return plan
        if plan is None and not leaner:
            # The pair's plan fitted the partition model but not its simulated
            # step: the pair's leaner submesh plans compete in their turn (by
            # step), as the search would have found them had the model known.
            for found, plan_n, chain_n in _leaner_partitions(
                    prepare(m), stages, m, units, schedule, memory_budget_bytes, optimizer,
                    stacks, shared_slowdown, sub_plan, recompute):
                heapq.heappush(heap, (found.step_s, _VERIFY, n, m, next(order),
                                      (plan_n, found, chain_n, True)))
    _record_pruned(heap, mesh, candidates)
    if intra_op is not None:
        intra_op.solver["pipeline_candidates"] = candidates
        return intra_op
    if timeouts and not found_any and intra_op_error is None:
        raise timeouts[0]
    budget_text = f"{memory_budget_bytes or 0:.4g}"
    error = InfeasibleBudgetError(
        f"no pipeline of {tried} stages fits a memory budget of {budget_text} bytes per "
        "device" + _recomputing(recompute) + "; raise the budget, use more stages or devices",
        None)
    if least_peak is not None:
        error = _least_error(tried, budget_text, least_peak, "the leanest verified "
                             "pipeline's worst stage with its reserve")
    if name_least and memory_budget_bytes is not None and searched:
        leasts = [(x, n, m) for n, m in searched
                  if (x := _least_of_pair(prepare(m), cut_mesh(mesh, n), m, units, schedule,
                                          optimizer, stacks, recompute)) is not None]
        if leasts:
            # Only the pair of the least is searched at it: the others do not
            # fit there by the model, and a search of all would verify that
            # pair's plans all the same (each pair's retries are its own).
            least, least_n, least_m = min(leasts)

            def search_at(budget: float) -> Plan:
                return search_pipeline(prepare, mesh, budget, [least_n],
                                       microbatches=lambda _: [least_m], schedule=schedule,
                                       optimizer=optimizer, stacks=stacks, intra_op=None,
                                       explicit=explicit, shared_slowdown=shared_slowdown,
                                       work_s=work_s, name_least=False, recompute=recompute)

            fitted, error = _least_named(least, search_at, memory_budget_bytes, tried,
                                         budget_text, error, recompute)
            if fitted is not None:
                return fitted
    named = error.smallest_feasible_budget_bytes
    intra_least = intra_op_error.smallest_feasible_budget_bytes if intra_op_error else None
    if intra_op_error is not None and (
            named is None or (intra_least is not None and intra_least <= named)):
        raise intra_op_error
    raise error


def _recomputing(recompute: bool) -> str:
    """What an error says the search allowed its stages."""
    return (", even with stages recomputing their forward" if recompute else
            " without stages recomputing their forward (checkpointing='off')")


def _least_error(tried: list[int], budget_text: str, least: float, what: str,
                 why: str = " in its simulated step (the model's plans exceed it)"
                 ) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(
        f"no pipeline of {tried} stages fits a memory budget of {budget_text} bytes per "
        f"device{why}; the smallest feasible budget is about {least:.4g} bytes "
        f"({least / 2**20:.1f} MiB, {what})", int(np.ceil(least)))


def _least_of_pair(one: Microbatched, stages, microbatches: int, units: int, schedule: str,
                   optimizer, stacks, recompute: bool = True) -> float | None:
    """The least budget at which the partition model fits ``n`` stages of
    ``microbatches`` microbatches (``stages``): the partition DP's least
    (``least_budget``) over the leanest submesh plan's chain (the plan at the
    least budget a 1-byte search of the submesh names). None where that plan
    is not found."""
    leanest = _leanest_submesh(one, stages)
    if leanest is None:
        return None
    plan_n, table = leanest
    chain = build_chain(one.traced, one.profile, table, choice_of_plan(table, plan_n),
                        one.blocks, stacks)
    found = [least_budget(chain, stages, microbatches, schedule, optimizer, virtual=v,
                          recompute=recompute)
             for v in virtual_counts(schedule, stages.count, units)]
    return min((x for x in found if x is not None), default=None)


#: Searches at the least a failed search names, each at the one the last named
#: (as ``search.LEANEST_TRIES``).
LEANEST_TRIES = 3


def _leanest_submesh(one: Microbatched, stages):
    """The submesh plan at the least budget a 1-byte search of the submesh
    names (and, where that search finds nothing, at the least it names in
    turn, up to ``LEANEST_TRIES``), with its strategy table; None where none
    is found."""
    least = 1.0
    for _ in range(LEANEST_TRIES + 1):
        try:
            return one.plan_submesh(stages.submesh, least)
        except InfeasibleBudgetError as err:
            named = err.smallest_feasible_budget_bytes
            if not named or named <= least:
                return None
            least = float(named) * (1 + 1e-6)
        except SolverTimeLimitError:
            return None
    return None


def _best_split(chain: Chain, stages, microbatches: int, units: int, schedule: str, budget,
                optimizer, shared_slowdown: float, recompute: bool = True
                ) -> Partition | None:
    """``best_partition`` over the chunks per rank the schedule allows
    (``virtual_counts``): the fastest split, None where none fits."""
    split = None
    for v in virtual_counts(schedule, stages.count, units):
        part = best_partition(chain, stages, microbatches, schedule, budget, optimizer,
                              recompute=recompute, virtual=v, shared_slowdown=shared_slowdown)
        if part is not None and (split is None or part.step_s < split.step_s):
            split = part
    return split


def _least_named(least: float, search_at: Callable[[float], Plan], budget: float,
                 tried: list[int], budget_text: str, error: InfeasibleBudgetError,
                 recompute: bool) -> tuple[Plan | None, InfeasibleBudgetError]:
    """The pipeline search at the partition model's ``least`` budget and, where
    its simulated step does not fit there, at the least each failed search
    names: (the plan found, if it fits ``budget``; else the error naming that
    plan's worst stage peak with its reserve, or ``error`` where no search
    succeeded). Every budget from the named one up plans: the search at it
    fails or plans, and where it fails, it comes here and finds the same plan,
    which fits. The budget the search ran at is not named: the partition
    model over-estimates recomputing stages, and the trust GPT-2's interleaved
    pipeline named 47.5 MiB where every budget from 35.0 MiB (its plan's
    simulated peak) planned."""
    for _ in range(LEANEST_TRIES):
        at = float(np.ceil(least * (1 + 1e-6)))
        try:
            found = search_at(at)
        except InfeasibleBudgetError as again:
            named = again.smallest_feasible_budget_bytes
            if not named or named <= least:
                return None, error
            least = float(named)
            continue
        peak = found.predicted_peak_memory_bytes
        if peak <= budget:
            return found, error
        return None, _least_error(tried, budget_text, peak, "the worst stage's simulated peak "
                                  "with its reserve, of the plan the search finds there",
                                  _recomputing(recompute))
    return None, error



def _candidate(stages, microbatches: int, bound_s: float, found: Partition | None,
               seconds: float, pruned: bool = False) -> dict:
    """One (n, M) pair's entry in ``solver["pipeline_candidates"]``."""
    return {"stages": stages.count, "submesh_shape": list(stages.submesh_shape),
            "microbatches": microbatches,
            "step_s": None if found is None else found.step_s,
            "virtual_stages": None if found is None else found.virtual,
            "lower_bound_s": bound_s, "pruned": pruned, "search_s": seconds}


def _record_pruned(heap: list[tuple], mesh, candidates: list[dict]) -> None:
    """Records the pairs left unsearched in ``heap`` (their bound is no better
    than a pipeline already found, or than the intra-op plan)."""
    for entry in sorted(heap):
        if entry[1] == _SEARCH:
            candidates.append(_candidate(cut_mesh(mesh, entry[2]), entry[3], entry[0], None,
                                         0.0, pruned=True))


def _search_count(one: Microbatched, stages, n: int, microbatches: int, units: int,
                  schedule: str, budget, optimizer, stacks, shared_slowdown: float,
                  timeouts: list, recompute: bool = True):
    """The best partition of ``n`` stages with ``microbatches`` microbatches
    (``one``: their trace): the submesh plan within ``n`` times the budget, then
    leaner ones while the best split recomputes (``leaner_budgets``); (the
    partition, its submesh plan, its chain), Nones when no split fits (a
    submesh ILP out of time is appended to ``timeouts``)."""
    found, sub_plan, chain = None, None, None
    tried: list[tuple[Plan, object, Chain]] = []  # every submesh plan and its chain
    budgets = [None if budget is None else budget * n]
    leaner = leanest = probed = False  # each tried once
    while budgets:
        try:
            plan_n, table = one.plan_submesh(stages.submesh, budgets.pop(0))
        except SolverTimeLimitError as err:
            # One (n, M) whose submesh ILP finds no plan in time: the others
            # still compete (the intra-op plan, or an explicit count alone,
            # raises it where nothing else is found).
            log.warning("%d stages, %d microbatches: %s", n, microbatches, err)
            timeouts.append(err)
            break
        except InfeasibleBudgetError as err:
            least = err.smallest_feasible_budget_bytes
            if leanest or not least:
                break
            budgets, leanest, leaner = [float(least) * (1 + 1e-6)], True, True
            continue
        chain_n = build_chain(one.traced, one.profile, table, choice_of_plan(table, plan_n),
                              one.blocks, stacks)
        tried.append((plan_n, table, chain_n))
        split = _best_split(chain_n, stages, microbatches, units, schedule, budget, optimizer,
                            shared_slowdown, recompute)
        if split is not None and (found is None or split.step_s < found.step_s):
            found, sub_plan, chain = split, plan_n, chain_n
        if found is not None and not any(found.recompute):
            break  # a leaner intra-op plan would be slower
        if not leaner and budget is not None:
            budgets, leaner = leaner_budgets(plan_n), True
        if not budgets and not (leanest or probed) and budget is not None:
            # The leaner plans did not fit either, or their best split still
            # recomputes: the leanest one (the plan at the least budget a
            # 1-byte search names) is the last try, so that a pair fits
            # wherever its least (``_least_of_pair``) allows, and a split
            # that keeps its activations is not missed where only a leaner
            # plan makes room for them (the trust GPT-2 on 2 ranks x 2, M = 8,
            # interleaved, at 0.97 of its unconstrained peak: 2079 ms
            # recomputing against 1716 ms without, its ILP peak at the
            # optimizer step, so no leaner budgets to try).
            budgets, probed = [1.0], True
    if found is not None and len(tried) > 1 and budget is not None:
        mixed = _mixed(one, stages, microbatches, units, schedule, budget, optimizer, stacks,
                       shared_slowdown, tried, found, recompute)
        if mixed is not None:
            found, sub_plan, chain = mixed
    return found, sub_plan, chain


def _mixed(one: Microbatched, stages, microbatches: int, units: int, schedule: str, budget,
           optimizer, stacks, shared_slowdown: float, tried, found: Partition,
           recompute: bool = True):
    """Stages running different submesh plans of ``tried`` (``best_mixed_split``:
    a stage holding more microbatches in flight may take a leaner plan than
    the others), merged into one plan (``pipeline_merge``) and priced again on
    its own chain (the conversions at the cuts between the plans included):
    (partition, plan, chain) where that is faster than ``found`` and fits
    ``budget``, else None. Depth-reduced chains (a traced block standing for
    several stages' layers) are not mixed."""
    if stacks or any(u.repeat for _, _, c in tried for u in c.units):
        return None
    best = None
    for v in virtual_counts(schedule, stages.count, units):
        split = best_mixed_split([c for _, _, c in tried], stages, microbatches, schedule,
                                 budget, optimizer, recompute=recompute, virtual=v)
        if split is None or len(set(split.plan_of)) < 2 or split.step_s >= found.step_s:
            continue
        base, table, chain = tried[split.plan_of[0]]
        firsts = [chain.order[chain.units[a].first] for a, _ in split.bounds]
        merged = merged_plan([tried[i][0] for i in split.plan_of],
                             stage_of_nodes(base, chain.order, firsts))
        merged_chain = build_chain(one.traced, one.profile, table, choice_of_plan(table, merged),
                                   one.blocks, stacks)
        part = bounds_partition(merged_chain, stages, split.bounds, split.recompute,
                                microbatches, schedule, optimizer, v, shared_slowdown)
        if max(part.peak_bytes) > budget or part.step_s >= found.step_s:
            continue
        if best is None or part.step_s < best[0].step_s:
            solver = {**merged.solver, "pipeline_stage_plans": [
                {"plan": i, "intra_op_step_s": tried[i][0].predicted_step_s,
                 "intra_op_peak_bytes": tried[i][0].predicted_peak_memory_bytes}
                for i in split.plan_of]}
            best = (part, dataclasses.replace(merged, solver=solver), merged_chain)
    if best is not None:
        log.info("%d stages: plans mixed per stage, step %.3f ms against %.3f ms with one",
                 stages.count, best[0].step_s * 1e3, found.step_s * 1e3)
    return best


def _leaner_partitions(one: Microbatched, stages, microbatches: int, units: int,
                       schedule: str, budget, optimizer, stacks, shared_slowdown: float,
                       failed: Plan, recompute: bool = True
                       ) -> list[tuple[Partition, Plan, Chain]]:
    """The best partitions of the submesh plans leaner than ``failed`` (whose
    pipeline's simulated step did not fit ``budget``): the plans keeping a
    share of its activations (``leaner_budgets``) and the leanest one, each
    distinct plan's best split within ``budget``."""
    if budget is None:
        return []
    seen = {(failed.predicted_step_s, failed.predicted_peak_memory_bytes)}
    out = []
    plans = []
    for asked in leaner_budgets(failed):
        try:
            plans.append(one.plan_submesh(stages.submesh, asked))
        except (InfeasibleBudgetError, SolverTimeLimitError):
            continue
    leanest = _leanest_submesh(one, stages)
    for plan_n, table in plans + ([leanest] if leanest is not None else []):
        key = (plan_n.predicted_step_s, plan_n.predicted_peak_memory_bytes)
        if key in seen:
            continue
        seen.add(key)
        chain = build_chain(one.traced, one.profile, table, choice_of_plan(table, plan_n),
                            one.blocks, stacks)
        split = _best_split(chain, stages, microbatches, units, schedule, budget, optimizer,
                            shared_slowdown, recompute)
        if split is not None:
            out.append((split, plan_n, chain))
    return out


def _verified(sub_plan: Plan, partition: Partition, stages, chain, microbatches: int,
              schedule: str, budget, optimizer, intra_s, candidates, t0: float,
              simulate: Callable | None, shared_slowdown: float = 1.0,
              recompute: bool = True) -> tuple[Plan | None, float | None]:
    """The pipelined plan of ``partition`` with each stage's peak from its
    simulated step, re-partitioned against per-stage budgets corrected by
    simulated/modelled while a stage exceeds ``budget``: (the plan or None, the
    least simulated worst-stage peak with its reserve seen, None if unsimulated)."""
    def pipelined(split: Partition) -> Plan:
        return _pipelined(sub_plan, split, stages, chain, microbatches, schedule, budget,
                          intra_s, candidates, time.perf_counter() - t0)

    if simulate is None:
        return pipelined(partition), None
    n = stages.count
    budgets = [budget] * n
    least: float | None = None
    for rounds in range(1, VERIFY_ROUNDS + 1):
        plan = pipelined(partition)
        with progress_stage(log, f"simulated {n} pipeline stages") as simulating:
            steps = [simulate(plan, k) for k in range(n)]
            simulating.result(", ".join(f"{s.peak_bytes / 2**20:.1f}" for s in steps) + " MiB")
        kept = [reserved(step, STAGE_HEADROOM) for step in steps]
        plan = _with_simulated(plan, partition, steps, kept)
        plan.solver["pipeline_verify_rounds"] = rounds
        peaks = [k.peak_bytes for k in kept]
        least = max(peaks) if least is None else min(least, max(peaks))
        if budget is None or max(peaks) <= budget:
            return plan, least
        budgets = [min(b, budget * modelled / peak) * 0.995 if peak > budget else b
                   for b, modelled, peak in zip(budgets, partition.peak_bytes, peaks)]
        log.info("simulated stage peaks %s MiB exceed the budget; partitioning again within "
                 "per-stage model budgets %s MiB", [round(p / 2**20, 1) for p in peaks],
                 [round(b / 2**20, 1) for b in budgets])
        split = best_partition(chain, stages, microbatches, schedule, budgets, optimizer,
                               recompute=recompute, virtual=partition.virtual,
                               shared_slowdown=shared_slowdown)
        if split is None:
            break
        partition = split
    return None, least


def _with_simulated(plan: Plan, partition: Partition, steps, kept) -> Plan:
    """``plan`` with each stage's peak from its simulated step (``steps``, one per
    rank; ``kept``, the same with their reserve), the model's kept beside it."""
    record = plan.pipeline
    assert record is not None
    n = len(steps)  # one simulated step per rank, for all its chunks (j mod n)
    stages = tuple(dataclasses.replace(
        s, predicted_peak_memory_bytes=float(kept[j % n].peak_bytes),
        modelled_peak_memory_bytes=float(partition.peak_bytes[j]))
        for j, s in enumerate(record.stages))
    worst = max(range(len(steps)), key=lambda k: steps[k].peak_bytes)
    step, worst_kept = steps[worst], kept[worst]
    solver = {**plan.solver, "simulated": True,
              "modelled_peak_bytes": max(partition.peak_bytes),
              "pipeline_stage_peaks": [{"modelled_bytes": float(m),
                                        "simulated_bytes": float(s.peak_bytes)}
                                       for m, s in zip(partition.peak_bytes, steps)]}
    return dataclasses.replace(
        plan, predicted_peak_memory_bytes=float(worst_kept.peak_bytes),
        memory_breakdown=worst_kept.breakdown,
        memory_breakdown_at=f"stage {worst}, {step.phase} (simulated step)",
        memory_timeline=worst_kept.timeline,
        solver=solver, pipeline=dataclasses.replace(record, stages=stages))


def _pipelined(sub_plan: Plan, partition: Partition, stages, chain, microbatches: int,
               schedule: str, budget, intra_s, candidates, search_s: float) -> Plan:
    units, order = chain.units, chain.order
    records = []
    for k, (a, b) in enumerate(partition.bounds):
        first, last = units[a], units[b - 1]
        records.append(StageRecord(
            index=k, first_node=order[first.first], last_node=order[last.last],
            ranks=stages.stage_ranks[k % stages.count], predicted_forward_s=partition.forward_s[k],
            predicted_backward_s=partition.backward_s[k],
            predicted_peak_memory_bytes=partition.peak_bytes[k],
            first_repeat=first.repeat, last_repeat=last.repeat,
            recompute=partition.recompute[k]))
    record = PipelineRecord(
        mesh=stages.mesh.to_dict(), submesh_shape=stages.submesh_shape,
        microbatches=microbatches, schedule=schedule, stages=tuple(records),
        predicted_step_s=partition.step_s, send_s=tuple(partition.send_s),
        intra_op_step_s=intra_s, tail_s=partition.tail_s, tied_s=partition.tied_s,
        virtual_stages=partition.virtual)
    peak = max(partition.peak_bytes)
    worst = partition.peak_bytes.index(peak)
    forward = sum(partition.forward_s)
    backward = sum(partition.backward_s)
    solver = {**sub_plan.solver, "pipeline_candidates": candidates,
              "pipeline_search_s": search_s}
    return dataclasses.replace(
        sub_plan, predicted_step_s=partition.step_s,
        predicted_peak_memory_bytes=peak,
        memory_budget_bytes=budget,
        memory_binding=False,
        memory_breakdown={"stage peak (parameters, optimizer state, gradients, in-flight "
                          "activations, temporaries)": peak},
        memory_breakdown_at=f"stage {worst} (pipeline memory model)",
        memory_timeline=None,
        step_time={**sub_plan.step_time, "pipeline_forward_s": forward,
                   "pipeline_backward_s": backward},
        solver=solver, pipeline=record)


def reprice_pipeline(traced, profile, plan: Plan, device, optimizer: str = "adamw",
                     mesh=None) -> Partition:
    """The ``Partition`` of ``plan``'s stages (``plan.pipeline`` set; ``traced`` and
    ``profile``: its one microbatch) priced on ``device`` and ``mesh`` (the whole
    pipeline mesh, default the record's; same shape): the same submesh plan and
    stage bounds under other speeds, as ``search.reprice`` does for an intra-op
    plan."""
    from automap.sharding.mesh import DeviceMesh
    from automap.solve.blocks import detect_blocks
    from automap.solve.strategies import build_strategy_table

    record = plan.pipeline
    if record is None:
        raise InvalidPipelineError("reprice_pipeline needs a plan with pipeline stages")
    stages = cut_mesh(mesh or DeviceMesh.from_dict(record.mesh), record.stage_count)
    table = build_strategy_table(traced, profile, stages.submesh, device=device,
                                 optimizer=optimizer)
    chain = build_chain(traced, profile, table, choice_of_plan(table, plan),
                        detect_blocks(traced), ())
    start = {chain.order[u.first]: i for i, u in enumerate(chain.units)}
    firsts = [start[s.first_node] for s in record.stages]
    bounds = list(zip(firsts, [*firsts[1:], len(chain.units)]))
    return price_bounds(chain, stages, bounds, [s.recompute for s in record.stages],
                        record.microbatches, record.schedule,
                        shared_slowdown=device.shared_slowdown,
                        virtual=record.virtual_stages)
