"""The intra-op ILP (MAP section 5.1, Alpa's formulation), solved with HiGHS.

- One binary per strategy of each node with a choice, one-hot per node.
- Edges: one continuous variable per pair of *distinct* specs on the two
  sides (producer output spec, consumer input spec), priced with the
  resharding cost, with marginal equalities to both sides' choices; that
  keeps the LP relaxation tight and the edge count far below strategy pairs.
  An edge with one distinct spec on a side folds into the other side's costs.
- Followers (single-input nodes; with ``reduce_formulation`` elementwise
  nodes of several inputs too) ride on a producer's choice unless
  ``merge_followers=False``: Alpa's reduction, far fewer variables
  (``automap.solve.reduce``).
- Repeated blocks (TAP) share the first instance's variables, so the
  problem does not grow with depth; boundary edges stay exact.
- Objective: estimated step time in seconds (compute + node collectives +
  conversions, forward and backward, + the optimizer step), every term in
  sequence (the reported prediction overlaps gradient buckets, see
  ``planner/step_time.py``).
- Readers of one activation that share its gradient all-reduce
  (``solve/shared_gradients.py``) pay it once: an OR variable per group.
- Memory: the rows of ``automap.solve.memory``'s model (the forward and the
  backward of every node where memory changes, and the optimizer step) must
  fit the budget; running sums keep the rows short.
Coefficients are gathered as numpy arrays per node and per edge, never one
Python call per coefficient.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from functools import cached_property

import highspy
import numpy as np

from automap.errors import InfeasibleBudgetError, InvalidArgumentError, SolverTimeLimitError
from automap.progress import stage
from automap.sharding.layout import ConversionNetwork, conversion_network, resharding_cost_matrix
from automap.solve.flow_edges import (
    ClassCoupling,
    add_class_coupling,
    add_flow_edge,
    class_coupling,
)
from automap.solve.memory import (
    edge_memory,
    estimate_memory,
    least_held_bytes,
    loop_carry,
    optimizer_temporaries,
    timeline,
    waiting_gradient_bytes,
)
from automap.solve.reduce import groups
from automap.solve.shared_gradients import UNSHARED_KINDS
from automap.solve.strategies import ShardCounts, StrategyTable

log = logging.getLogger(__name__)

@dataclass
class IlpSolution:
    choice: dict[str, int]
    objective_s: float
    gap: float
    status: str
    peak_memory_bytes: float
    memory_binding: bool
    build_s: float
    solve_s: float
    num_binaries: int
    num_edge_variables: int
    num_rows: int


class _Builder:
    def __init__(self) -> None:
        self.cost: list[np.ndarray] = []
        self.lower: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []
        self.ncol = 0
        self.nonzeros = 0  # set by lp()
        self.rows_lo: list[float] = []
        self.rows_hi: list[float] = []
        self.entry_row: list[np.ndarray] = []
        self.entry_col: list[np.ndarray] = []
        self.entry_val: list[np.ndarray] = []

    def columns(self, cost, integer: bool, upper=1.0, lower=0.0) -> np.ndarray:
        cost = np.asarray(cost, dtype=np.float64)
        n = len(cost)
        cols = np.arange(self.ncol, self.ncol + n)
        self.ncol += n
        self.cost.append(cost)
        self.lower.append(np.full(n, lower))
        self.upper.append(np.full(n, upper))
        self.integer.append(np.full(n, integer))
        return cols

    def rows(self, lo, hi) -> np.ndarray:
        lo, hi = np.atleast_1d(lo).astype(float), np.atleast_1d(hi).astype(float)
        first = len(self.rows_lo)
        self.rows_lo.extend(lo.tolist())
        self.rows_hi.extend(hi.tolist())
        return np.arange(first, first + len(lo))

    def entries(self, rows, cols, vals) -> None:
        rows, cols = np.asarray(rows), np.asarray(cols)
        vals = np.broadcast_to(np.asarray(vals, dtype=np.float64), rows.shape)
        self.entry_row.append(rows)
        self.entry_col.append(cols)
        self.entry_val.append(vals)

    def lp(self, cost_override=None):
        if not self.ncol:  # nothing to choose: one idle column keeps HiGHS's model valid
            self.columns([0.0], integer=False)
        lp = highspy.HighsLp()
        lp.num_col_ = self.ncol
        lp.num_row_ = len(self.rows_lo)
        cost = np.concatenate(self.cost) if cost_override is None else cost_override
        upper = np.concatenate(self.upper)
        # A column held at 0 costs nothing: its price (a banned conversion's
        # ``_FORBIDDEN_S``) only scaled the LP badly (the test T5 on (2,):
        # costs from 1 to 1e9, which HiGHS warns about; the same optimum).
        lp.col_cost_ = np.where(upper == 0.0, 0.0, cost)
        lp.col_lower_ = np.concatenate(self.lower)
        lp.col_upper_ = upper
        lp.row_lower_ = np.array(self.rows_lo)
        lp.row_upper_ = np.array(self.rows_hi)
        rows = np.concatenate(self.entry_row) if self.entry_row else np.zeros(0, int)
        cols = np.concatenate(self.entry_col) if self.entry_col else np.zeros(0, int)
        vals = np.concatenate(self.entry_val) if self.entry_val else np.zeros(0)
        order = np.lexsort((rows, cols))
        rows, cols, vals = rows[order], cols[order], vals[order]
        if len(rows):
            # Tied nodes put the same column into one row more than once: add them.
            first = np.ones(len(rows), dtype=bool)
            first[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
            groups = np.cumsum(first) - 1
            vals = np.bincount(groups, weights=vals)
            rows, cols = rows[first], cols[first]
        starts = np.searchsorted(cols, np.arange(self.ncol + 1))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = starts.astype(np.int32)
        lp.a_matrix_.index_ = rows.astype(np.int32)
        lp.a_matrix_.value_ = vals
        self.nonzeros = len(vals)
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in np.concatenate(self.integer)]
        return lp


def solve_ilp(table: StrategyTable, memory_budget_bytes: float | None = None, **options
              ) -> IlpSolution:
    """One solve of ``ShardingIlp(table, **options)`` (see there)."""
    return ShardingIlp(table, **options).solve(memory_budget_bytes)


@dataclass
class _Model:
    """One built formulation and the HiGHS instances solving it (made when
    first needed): its LP relaxation, the MIP, and the Lagrangian LP (the
    budget rows dropped, their dual prices added to the costs: what finds
    a plan near the least budget)."""

    lp: highspy.HighsLp
    cols: dict[str, np.ndarray]
    constant_s: float
    budget_col: int | None
    mem_unit: float
    build_s: float
    num_binaries: int
    num_edge_variables: int
    line: object
    limit_rows: np.ndarray  # rows bounded by the budget: activity <= budget + upper
    #: Entries of the constraint matrix (highspy copies ``a_matrix_.value_``
    #: into a Python list on every read: 0.08 s on GPT-2 small (2,2,2)).
    nonzeros: int = 0
    #: Columns with a pair column per spec pair on every edge: what decides
    #: branch and bound against dives (``exact_columns`` was measured on
    #: that formulation; flow edges leave the choice as it was).
    pair_columns: int = 0
    relaxed: highspy.Highs | None = None
    #: The budget whose optimal relaxation ``relaxed`` holds (None: none).
    relaxed_at: float | None = None
    #: An optimal relaxation set aside while ``relaxed`` solves another
    #: budget: (its budget, its instance), or None.
    parked: tuple[float, highspy.Highs] | None = None
    least_relaxed: highspy.Highs | None = None
    #: Whether ``least_relaxed`` ran to an end (an optimum, a proof, the time
    #: limit), not only to a work limit it may resume from.
    least_ended: bool = False
    mip: highspy.Highs | None = None
    lagrangian: highspy.Highs | None = None
    #: The costliest plan's objective in seconds (``_Ceiling``; inf: not known).
    costliest_plan_s: float = math.inf

    @cached_property
    def binaries(self) -> np.ndarray:
        return np.concatenate(list(self.cols.values())) if self.cols else np.zeros(0, int)

    def integral(self, x: np.ndarray) -> bool:
        v = x[self.binaries]
        return bool(np.all(np.minimum(np.abs(v), np.abs(1 - v)) <= _INTEGRAL))

    def cost(self) -> np.ndarray:
        return np.asarray(self.lp.col_cost_)

    def limit_uppers(self) -> np.ndarray:
        return np.asarray(self.lp.row_upper_)[self.limit_rows]

    def objective_ceiling(self) -> float:
        """A cost above every plan's (its binaries integral, the other columns
        at their cheapest): per choice its costliest option, summed
        (``costliest_plan_s``), doubled against the solver's tolerances. Where
        the dual simplex's objective passes it, no plan fits: long before it
        proves infeasibility otherwise (GPT-2 small on (2,2,2), whole
        parameters at 2.96 GiB: 1.9e10 against a ceiling of 1.3e9 after 1.9 k
        iterations, 0.5 s; without it the proof stalled the 60 s limit removing
        the cost perturbation). The plans' own ceiling is tighter than every
        column at its costliest bound (the relaxation's points; 1.3e9 there)
        and the proofs come sooner: GPT-2 small (2,2,2) at 0.5x, the 3.46 GB
        rung's probe 0.79 s against 1.65 s; (4,4,4) at 0.5x, the 1.5 GiB
        rung's dive 3.5 against 5.9 s. Inf where columns are unbounded and
        priced outside the choices."""
        if math.isfinite(self.costliest_plan_s):
            return 2.0 * (self.costliest_plan_s * _US + abs(float(self.lp.offset_))) + 1.0
        cost = np.asarray(self.lp.col_cost_)
        used = cost != 0
        lower = np.asarray(self.lp.col_lower_)[used]
        upper = np.asarray(self.lp.col_upper_)[used]
        costliest = np.maximum(cost[used] * lower, cost[used] * upper)
        if not np.all(np.isfinite(costliest)):
            return math.inf
        return 2.0 * (float(np.abs(costliest).sum()) + abs(float(self.lp.offset_))) + 1.0

    def dual_prices(self, row_dual: np.ndarray) -> np.ndarray:
        """Per column, the budget rows' dual prices times its coefficients
        in them: what one unit of the column costs in the Lagrangian."""
        a = self.lp.a_matrix_
        start = np.asarray(a.start_)
        rows, vals = np.asarray(a.index_), np.asarray(a.value_)
        price = np.zeros(self.lp.num_row_)
        price[self.limit_rows] = np.abs(row_dual[self.limit_rows])
        col_of_entry = np.repeat(np.arange(self.lp.num_col_), np.diff(start))
        return np.bincount(col_of_entry, weights=price[rows] * vals, minlength=self.lp.num_col_)


def _load(lp: highspy.HighsLp, time_limit_s: float, mip_rel_gap: float, relax: bool
          ) -> highspy.Highs:
    h = _highs(time_limit_s, mip_rel_gap)
    h.passModel(lp)
    if relax:  # HiGHS's presolve takes 8x the simplex's own time on these LPs
        h.setOptionValue("presolve", "off")
        n = lp.num_col_
        h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.uint8))
    return h


#: Budgeted ILPs up to this many columns go to branch and bound (exact);
#: above it HiGHS's MIP takes minutes (GPT-2 small on (2,2,2): 215 k columns,
#: no feasible plan in 120 s) and LP dives take seconds.
EXACT_COLUMNS = 20_000

#: How an edge between two nodes of several strategies each is priced:
#: "flow" (default) routes its conversions through the network of their
#: optimal paths' single steps where the build has no memory rows
#: (``solve/flow_edges.py``: a column per step instead of one per spec pair;
#: the same LP value, so the same optimum); "flow-memory" does so under a
#: budget too, counting the conversions' buffers by shard-count class (the
#: same integral plans, a looser relaxation: LP dives take other paths, and
#: on the test BERT on (2,2,2) at 0.5x the plan was 0.36 % slower, while
#: GPT-2 small on (2,2,4) planned in half the HiGHS time); "pairs" is one
#: column per (producer spec, consumer spec) pair everywhere (the
#: formulation before flow edges). Where the network is no smaller, or an
#: edge's buffers depend on the specs themselves, the edge keeps pairs.
EDGE_FORMULATIONS = ("flow", "flow-memory", "pairs")
EDGE_FORMULATION = "flow"  # ShardingIlp's default (benches compare them)

#: Under a budget ("flow-memory"), an edge takes flow columns only where they are this many
#: times fewer than its pairs: the class coupling relaxes memory and time
#: apart, and on GPT-2 small on (2,4) (blocks of about 9 x 9 pairs, 3x fewer
#: columns) the budgeted LPs took 1.8x the simplex iterations of pairs.
BUDGETED_FLOW_SHRINK = 4.0
#: A dive fixes at most this many roots, tries this many strategies per
#: root, and gives up after this many fixes that made the LP infeasible
#: (near the least budget each such proof costs a slow LP solve).
_DIVE_STEPS, _DIVE_TRIES, _DIVE_FAILURES = 400, 2, 4
#: One LP solve of a dive may take this many times the dive's slowest solve
#: so far, and at least ``DIVE_STEP_MIN_S``, before it counts as a fix that
#: failed (undone): warm from some dives' bases HiGHS's dual simplex slows a
#: hundredfold per iteration (GPT-2 small on (2,2,2) at 0.7x: re-solves
#: reached this cap after 5-15 s, where the dive's others took 0.1-3 s; HiGHS
#: checks its clock between phases, so a cap is overrun by seconds, and the
#: worst stall, 103 s, went past even the 60 s limit: ``MEMORY_QUANTUM`` is
#: what removed that one). Relative to the dive's own solves, so a loaded
#: machine, on which every solve slows, keeps the same path.
DIVE_STEP_FACTOR, DIVE_STEP_MIN_S = 10.0, 5.0
#: The least-budget MIP's tie-break among plans of least peak: compute time,
#: all of it priced at this share of the least budget's LP bound.
LEAST_TIE_WEIGHT = 1e-5
#: A budgeted LP relaxation is first tried for this much simplex work (iterations
#: times the constraint matrix's nonzeros, which each iteration's pricing scans)
#: before the least-budget LP (slow on some models) decides whether the budget
#: can fit. A work limit, not a share of the time limit: a probe cut short sends
#: the search down another path, so a wall-clock limit made the plan depend on
#: the machine's load. This much is about the old share, 6 s, on a quiet
#: machine: GPT-2 small on (2,2,4) (0.80 M nonzeros) 16 k iterations, where
#: its probes and those on (2,2,2) took 3.3-7.9 k; a 2x4 mesh's LP (10 k
#: columns) is not cut short by it.
QUICK_LP_WORK = 1.3e10
#: ... and never fewer iterations than this (small models' LPs take little time).
QUICK_LP_MIN_ITERATIONS = 1_000
#: HiGHS's default simplex iteration limit (none).
_NO_ITERATION_LIMIT = 2**31 - 1
#: Statuses of a run that stopped without an answer and not at a limit:
#: HiGHS's "Unknown" (numerical trouble near the end of a dual simplex) and
#: "Not Set" (a run that ended on an error). Run again from where it stopped,
#: then from scratch, within the same limits: the second run decides in a
#: fraction of the first's time (GPT-2 small on (2,2,2) at 0.7x: "Unknown"
#: after 2.5 s, then infeasible in 0.2 s; "Not Set" after 0.3 s, then
#: optimal in 1.5 s), where taking the status as it is sent the search to the
#: least-budget LP (12-18 s) or to branch and bound on 210 k columns (no
#: plan in 60 s: the planning failed).
_UNDECIDED = (highspy.HighsModelStatus.kUnknown, highspy.HighsModelStatus.kNotset,
              highspy.HighsModelStatus.kSolveError)
#: Statuses that prove a budgeted relaxation has no feasible point: HiGHS's
#: "Infeasible", and "Bound on objective reached" under ``_Model.objective_ceiling``
#: (the dual simplex's objective, a lower bound on every feasible point's cost
#: once perturbations are removed, passed a cost no feasible point can have).
_NO_FEASIBLE_POINT = (highspy.HighsModelStatus.kInfeasible,
                      highspy.HighsModelStatus.kObjectiveBound)
#: A binary this close to 0 or 1 counts as integral.
_INTEGRAL = 1e-6


class ShardingIlp:
    """The intra-op ILP of one strategy table, built once and solved for as
    many budgets as the search asks: a budget is the bounds of one variable
    of the memory rows, so a new budget changes two numbers, not the model.

    Each solve runs the LP relaxation first (HiGHS's presolve off, warm
    started from the last solve): where it is integral, as it nearly always
    is without a budget, it is the ILP's optimum (GPT-2 small on (2,2,2):
    0.14 s against 5.2 s of branch and bound). A binding budget makes it
    fractional where plans trade time for memory; then models up to
    ``exact_columns`` columns go to branch and bound, larger ones to an LP
    dive (fix the most decided fractional choice, solve again, repeat), and
    the fastest of the plans found that fit is returned with its gap to the
    LP bound. An infeasible LP proves a budget infeasible; the least
    feasible budget is then an exact minimum for small models, and for large
    ones the peak of a plan found from the least-budget LP (between its
    bound and that peak no plan is searched for), kept so that a solve at
    that budget returns it.

    ``merge_followers`` shrinks the problem by letting single-input nodes read
    their producer's output as is (a restriction: exact optimality needs it
    off); ``reduce_formulation=True`` lets elementwise nodes of several
    inputs follow one producer too (``automap.solve.reduce``; off by default:
    it loses plans under tight budgets). ``blocks`` (from
    ``automap.solve.blocks.detect_blocks``) ties every instance of a
    repeated block to the first: one set of variables, costs summed over
    the instances. ``node_weight`` and ``edge_weight`` say how
    often a node or an edge occurs in the real model (depth-reduced planning,
    see ``automap.solve.depth``)."""

    def __init__(self, table: StrategyTable, *, time_limit_s: float = 60.0,
                 mip_rel_gap: float = 1e-6, merge_followers: bool = True,
                 blocks: list | None = None, node_weight: dict[str, float] | None = None,
                 edge_weight: dict[tuple, float] | None = None,
                 optimizer: str = "adamw", exact_columns: float = EXACT_COLUMNS,
                 reduce_formulation: bool = False, edge_formulation: str | None = None
                 ) -> None:
        edge_formulation = EDGE_FORMULATION if edge_formulation is None else edge_formulation
        if edge_formulation not in EDGE_FORMULATIONS:
            raise InvalidArgumentError(f"edge_formulation must be one of {EDGE_FORMULATIONS}, "
                                       f"got {edge_formulation!r}")
        self.table = table
        self.time_limit_s, self.mip_rel_gap = float(time_limit_s), float(mip_rel_gap)
        self.optimizer = optimizer
        self.exact_columns = exact_columns
        self.node_weight, self.edge_weight = node_weight or {}, edge_weight or {}
        reduced = groups(table, merge_followers=merge_followers, blocks=blocks,
                         reduce_formulation=reduce_formulation)
        self.root, self.index, self.members = reduced.root, reduced.index, reduced.members
        self._unconstrained: _Model | None = None
        self._budgeted: _Model | None = None
        self._solutions: dict[float | None, IlpSolution] = {}
        #: Plans found under a budget (peak in bytes, column values): starts
        #: and fallbacks for later budgets.
        self._fitting: list[tuple[float, np.ndarray]] = []
        self._least_bytes: float | None = None  # a budget some plan fits
        self._least_bound_bytes = 0.0  # a budget no plan fits below
        #: The LP relaxation's feasibility is monotone in the budget: proved
        #: infeasible at this budget (nothing fits at or below it), and
        #: feasible at this one (a plan may fit at or above it).
        self._lp_infeasible_bytes = 0.0
        self._lp_feasible_bytes = math.inf
        self._least_plan: np.ndarray | None = None  # large models: found with the least
        #: Budgets whose LP dive found no plan, with the relaxation's bound:
        #: the dive is not run again there (the two-stage ladder's first rung
        #: is often the budget the ILP-alone search asks next: 1.9 s again on
        #: GPT-2 small on (4,4,4)).
        self._dive_failed: dict[float, float] = {}
        #: Per edge's spec lists: their distinct specs, indices and conversion
        #: costs (a model's repeated blocks and both builds ask the same).
        self._edge_specs: dict[tuple, tuple] = {}
        self._edge_memory: dict[tuple, tuple | None] = {}  # likewise their bytes
        #: Per question, its flow network or None (``_network``).
        self._networks: dict[tuple, ConversionNetwork | None] = {}
        self._couplings: dict[tuple, ClassCoupling] = {}
        self.edge_formulation = edge_formulation

    def solve(self, memory_budget_bytes: float | None = None, *, find_least: bool = True
              ) -> IlpSolution:
        """One strategy per node minimising the estimated step time under the
        memory budget (None: unconstrained); ``InfeasibleBudgetError`` naming the
        least feasible budget when none fits (``find_least=False``: not looked
        for where no plan is known, where a caller only wants plans)."""
        key = None if memory_budget_bytes is None else float(memory_budget_bytes)
        if key in self._solutions:
            return self._solutions[key]
        fastest = self._solutions.get(None)
        if key is not None and fastest is not None and fastest.peak_memory_bytes <= key:
            # The unconstrained optimum fits: it is the optimum under the budget too.
            sol = replace(fastest, build_s=0.0, solve_s=0.0, memory_binding=False)
            self._solutions[key] = sol
            return sol
        t0 = time.perf_counter()
        if key is None:
            if self._unconstrained is None:
                with stage(log, "built the ILP without memory rows", min_s=1.0):
                    self._unconstrained = self._build(None)
            model = self._unconstrained
            x, status, bound = self._solve_unconstrained(model)
        else:
            if self._budgeted is None:
                with stage(log, "built the ILP with memory rows", min_s=1.0):
                    self._budgeted = self._build(key)
            model = self._budgeted
            if self._least_bytes is not None and key <= self._least_bytes * (1 + 1e-5):
                x, status, bound = self._solve_at_least(model, key)
            else:
                x, status, bound = self._solve_budgeted(model, key, find_least)
        solve_s = time.perf_counter() - t0
        sol = self._solution(model, x, status, bound, key, solve_s)
        if key is not None:
            self._fitting.append((sol.peak_memory_bytes, x))
        log.debug("ILP solve (budget %s): %s, objective %.6g s, gap %.3g, %.2f s", key, status,
                  sol.objective_s, sol.gap, solve_s)
        model.build_s = 0.0  # paid once
        self._solutions[key] = sol
        return sol

    def solves_exactly(self) -> bool:
        """Whether budgets are solved by branch and bound (ILPs up to
        ``exact_columns``): a fresh instance's plan at a budget is then a
        function of the budget alone, not of what was solved before."""
        model = self._budgeted or self._unconstrained
        return model is not None and self._exact(model)

    def least_memory_plan(self) -> IlpSolution | None:
        """The plan the least budget was found with (after a solve that named
        it): of least peak, ties broken by compute time alone, so the same
        whatever the links (the plan ``solve`` returns at the least budget is
        the fastest of least peak: link speeds choose it). None: not known."""
        model = self._budgeted
        if model is None or self._least_plan is None or self._least_bytes is None:
            return None
        return self._solution(model, self._least_plan, "least memory",
                              float(model.cost() @ self._least_plan), self._least_bytes, 0.0)

    def _solution(self, model: _Model, x: np.ndarray, status: str, bound: float,
                  key: float | None, solve_s: float) -> IlpSolution:
        choice = self._choice(model, x)
        peak = estimate_memory(self.table, choice, model.line, self.optimizer,
                               self.node_weight).peak_bytes
        objective = float(model.cost() @ x)
        return IlpSolution(
            choice=choice,
            objective_s=objective / _US + model.constant_s,
            gap=max(0.0, (objective - bound) / objective) if objective > 0 else 0.0,
            status=status,
            peak_memory_bytes=peak,
            memory_binding=key is not None and peak >= 0.999 * key,
            build_s=model.build_s,
            solve_s=solve_s,
            num_binaries=model.num_binaries,
            num_edge_variables=model.num_edge_variables,
            num_rows=model.lp.num_row_,
        )

    def could_fit(self, memory_budget_bytes: float) -> bool:
        """False when no plan fits the budget, proved by the LP relaxation
        (cheap: the least budget is not looked for); True when one may."""
        budget = float(memory_budget_bytes)
        if budget < self._least_bound_bytes or budget <= self._lp_infeasible_bytes:
            return False
        if budget in self._solutions or (self._least_bytes is not None
                                         and budget >= self._least_bytes):
            return True
        if budget >= self._lp_feasible_bytes:
            return True  # the relaxation is feasible under a smaller budget
        if any(sol.peak_memory_bytes <= budget for sol in self._solutions.values()):
            return True  # a plan already found fits: no LP needed to say so
        if self._budgeted is None:
            with stage(log, "built the ILP with memory rows", min_s=1.0):
                self._budgeted = self._build(budget)
        try:
            return self._relaxed(self._budgeted, budget, find_least=False) is not None
        except InfeasibleBudgetError:
            return False

    def least_bound_bytes(self) -> float:
        """A budget no plan fits below: the least-budget LP's optimum (solved
        here if no budgeted solve needed it; 0 before any budgeted solve)."""
        if self._budgeted is not None:
            self._least_relaxation(self._budgeted)
        return self._least_bound_bytes

    def _exact(self, model: _Model) -> bool:
        return max(model.pair_columns, model.lp.num_col_) <= self.exact_columns

    def _solve_unconstrained(self, model: _Model):
        """The optimum: the LP relaxation where it is integral, else branch
        and bound. (column values, status, lower bound on the objective)."""
        relaxed = self._relaxed(model, None)
        if relaxed is not None and model.integral(relaxed[0]):
            return relaxed[0], "Optimal", relaxed[1]
        return self._branch_and_bound(model, None)

    def _relaxed(self, model: _Model, budget: float | None, find_least: bool = True):
        """The LP relaxation's (column values, objective); None when it has
        no optimum (time limit). No plan fits: ``InfeasibleBudgetError``,
        naming the least budget with ``find_least``."""
        if model.relaxed is None:
            model.relaxed = self._relaxation(model)
        h = model.relaxed
        if budget is not None:
            if model.relaxed_at == budget:
                return self._feasible_at(h, budget)  # solved for this budget already
            parked = model.parked
            if parked is not None and parked[0] == budget:
                model.parked = None if model.relaxed_at is None else (model.relaxed_at, h)
                model.relaxed, model.relaxed_at = parked[1], budget
                return self._feasible_at(parked[1], budget)
            if model.relaxed_at is not None:
                # The ladder's bisection proves a larger rung feasible, then
                # probes smaller ones, then dives at the lowest that fits: its
                # optimum is set aside, instance and all, and the probes run on
                # another. Solving it again cost 1.8 s on GPT-2 small (2,2,2)
                # at 0.3x; restarting from its basis instead (stop 46) sends
                # the dive along other paths (the pricing weights differ).
                spare = self._relaxation(model) if parked is None else parked[1]
                model.parked = (model.relaxed_at, h)
                model.relaxed = h = spare
            # From scratch: warm from another budget's basis the dual simplex
            # took 1.4-4x the iterations and up to 5x the time of a cold solve
            # (GPT-2 small on (2,2,2): 6.0 s vs 1.3 s; a probe ran into its
            # iteration limit where a cold one proved infeasibility in 0.5 s).
            h.clearSolver()
            model.relaxed_at = None
            h.changeColBounds(model.budget_col, budget / model.mem_unit, budget / model.mem_unit)
            if budget <= self._lp_infeasible_bytes:
                self._infeasible(model, budget, find_least)  # a larger budget was proved so
            if model.least_relaxed is None and budget >= self._least_bound_bytes:
                # Tried first, briefly: a budget that fits solves fast (GPT-2 small
                # on (2,2,2): 1.3 s, where the least-budget LP takes 12-34 s), and
                # most that do not are proved so as fast (0.4-1.7 s; the search
                # bisects its ladder's rungs with these proofs).
                status = self._run(h, iterations=self._quick_iterations(model))
                if status == highspy.HighsModelStatus.kOptimal:
                    model.relaxed_at = budget
                    return self._feasible_at(h, budget)
                if status in _NO_FEASIBLE_POINT:
                    self._lp_infeasible_bytes = max(self._lp_infeasible_bytes, budget)
                    self._infeasible(model, budget, find_least)
            # Below the least-budget LP's optimum nothing fits: decided without
            # the budgeted LP, whose infeasibility proofs can stall the dual
            # simplex for minutes (GPT-2 small on (4,4,4): 119 s, where the
            # least-budget LP takes 0.8 s). Here for as much work as the probe,
            # once: on the test T5 on (2,2,2) (1.5 M columns) it ran into the
            # 60 s time limit, where the budget's own LP then took 17 s. Where it
            # is cut short, no bound: the budget's LP decides, as after a limit.
            if model.least_relaxed is None:
                self._least_relaxation(model, self._quick_iterations(model))
            if budget < self._least_bound_bytes:
                self._infeasible(model, budget, find_least)
        status = self._run(h)
        if status in _NO_FEASIBLE_POINT and budget is not None:
            self._lp_infeasible_bytes = max(self._lp_infeasible_bytes, budget)
            self._infeasible(model, budget, find_least)
        if status != highspy.HighsModelStatus.kOptimal:
            return None
        model.relaxed_at = budget
        return self._feasible_at(h, budget)

    def _relaxation(self, model: _Model) -> highspy.Highs:
        h = _load(model.lp, self.time_limit_s, self.mip_rel_gap, relax=True)
        h.setOptionValue("objective_bound", model.objective_ceiling())
        return h

    def _feasible_at(self, h: highspy.Highs, budget: float | None):
        """The optimal relaxation's (column values, objective); under a budget,
        every larger budget's relaxation is feasible too."""
        if budget is not None:
            self._lp_feasible_bytes = min(self._lp_feasible_bytes, budget)
        return np.asarray(h.getSolution().col_value), float(h.getInfo().objective_function_value)

    def _run(self, h: highspy.Highs, iterations: int | None = None,
             seconds: float | None = None):
        """Run ``h`` for at most ``time_limit_s`` more seconds (``seconds`` where
        that is less; HiGHS's limit counts the instance's whole run time) and,
        when given, ``iterations`` simplex iterations (counted per run), and
        return its status."""
        limit_s = self.time_limit_s if seconds is None else min(seconds, self.time_limit_s)
        end_s = h.getRunTime() + limit_s
        h.setOptionValue("time_limit", end_s)
        h.setOptionValue("simplex_iteration_limit",
                         _NO_ITERATION_LIMIT if iterations is None else int(iterations))
        if h.run() == highspy.HighsStatus.kError and \
                h.getModelStatus() == highspy.HighsModelStatus.kNotset:
            # HiGHS's thread scheduler is one per process: where another user
            # of highspy started it with other threads than our one, HiGHS
            # refuses to run (saying so only in its muted log).
            highspy.Highs.resetGlobalScheduler(True)
            h.run()
        for unperturbed in (True, False):
            if h.getModelStatus() not in _UNDECIDED or h.getRunTime() >= end_s:
                break
            # From scratch: the basis itself may be what went wrong. First
            # without the dual simplex's cost perturbation: GPT-2 small's first
            # probe on 2x4 at 0.3x ended "Unknown" after 1.9 s of 2.6 ms
            # iterations with it (the objective at 1e12 against a ceiling of
            # 6e5), and a warm rerun took 3.2 s more; without it, 0.05 s.
            h.clearSolver()
            if unperturbed:
                h.setOptionValue("dual_simplex_cost_perturbation_multiplier", 0.0)
            try:
                h.run()
            finally:
                h.setOptionValue("dual_simplex_cost_perturbation_multiplier", 1.0)  # its default
        return h.getModelStatus()

    @staticmethod
    def _quick_iterations(model: _Model) -> int:
        nonzeros = max(1, model.nonzeros)
        return max(QUICK_LP_MIN_ITERATIONS, int(QUICK_LP_WORK / nonzeros))

    def _infeasible(self, model: _Model, budget: float, find_least: bool = True):
        """Raise ``InfeasibleBudgetError`` naming the least budget (found once,
        where ``find_least``)."""
        if self._least_bytes is None and find_least:
            self._least_bytes = self._least(model)
        self._raise_infeasible(budget)

    def _least_relaxation(self, model: _Model, iterations: int | None = None) -> highspy.Highs:
        """The LP relaxation with the budget variable freed and minimised,
        solved once (for at most ``iterations`` simplex iterations more, where
        given: a later call resumes it); its optimum, a budget no plan fits
        below, is kept in ``_least_bound_bytes``."""
        if model.least_relaxed is None:
            lp = model.lp
            n = lp.num_col_
            cost = np.zeros(n)
            cost[model.budget_col] = 1.0
            h = _load(lp, self.time_limit_s, 1e-6, relax=True)
            h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
            h.changeColBounds(model.budget_col, 0.0, highspy.kHighsInf)
            model.least_relaxed = h
        h = model.least_relaxed
        if not model.least_ended:
            status = self._run(h, iterations=iterations)
            model.least_ended = status != highspy.HighsModelStatus.kIterationLimit
            if status == highspy.HighsModelStatus.kOptimal:
                bound = float(h.getInfo().objective_function_value) * model.mem_unit
                # Just under: the LP's own tolerances must not refuse a budget at it.
                self._least_bound_bytes = max(self._least_bound_bytes, bound * (1 - 1e-7))
        return h

    def _branch_and_bound(self, model: _Model, budget: float | None):
        if model.mip is None:
            model.mip = _load(model.lp, self.time_limit_s, self.mip_rel_gap, relax=False)
        h = model.mip
        if budget is not None:
            h.changeColBounds(model.budget_col, budget / model.mem_unit, budget / model.mem_unit)
            self._start(model, h, budget)
        status = self._run(h)
        info = h.getInfo()
        if status == highspy.HighsModelStatus.kInfeasible and budget is not None:
            self._infeasible(model, budget)
        if info.primal_solution_status != 2:  # no feasible solution
            raise SolverTimeLimitError(
                f"HiGHS found no feasible plan within {self.time_limit_s} s "
                f"(status: {h.modelStatusToString(status)}); raise time_limit_s")
        bound = float(info.mip_dual_bound) if np.isfinite(info.mip_dual_bound) else \
            float(info.objective_function_value)
        return np.asarray(h.getSolution().col_value), h.modelStatusToString(status), bound

    def _solve_at_least(self, model: _Model, budget: float):
        """The plan at the least budget, the same whatever was solved before
        (the least budget an error names is this plan's simulated peak): for
        small models branch and bound from scratch to optimality, for large
        ones the plan the least budget was found with."""
        if not self._exact(model) and self._least_plan is not None:
            return self._least_plan, "least", float(model.cost() @ self._least_plan)
        h = _load(model.lp, self.time_limit_s, 1e-6, relax=False)
        h.changeColBounds(model.budget_col, budget / model.mem_unit, budget / model.mem_unit)
        self._run(h)
        if h.getInfo().primal_solution_status != 2:
            return self._solve_budgeted(model, budget)
        info = h.getInfo()
        return (np.asarray(h.getSolution().col_value), h.modelStatusToString(h.getModelStatus()),
                float(info.mip_dual_bound))

    def _solve_budgeted(self, model: _Model, budget: float, find_least: bool = True):
        found = None
        if budget in self._dive_failed:
            bound = self._dive_failed[budget]
        else:
            relaxed = self._relaxed(model, budget)
            if relaxed is None:
                return self._branch_and_bound(model, budget)
            x, bound = relaxed
            if model.integral(x):
                return x, "Optimal", bound
            found = self._dive(model, model.relaxed, x, self._cutoff(model, budget))
            model.relaxed_at = None  # the dive re-solved it under fixed bounds
            if found is not None:
                self._fitting.append((self._peak(model, found), found))
            else:
                self._dive_failed[budget] = bound
        if self._exact(model):
            return self._branch_and_bound(model, budget)  # the dive's plan is its start
        cost = model.cost()
        fitting = [x for peak, x in self._fitting if peak <= budget]
        if found is None and not fitting and self._least_bytes is None and find_least:
            self._least_bytes = self._least(model)  # its plan is one more candidate
            fitting = [x for peak, x in self._fitting if peak <= budget]
        if found is not None:
            fitting.append(found)
        if not fitting:
            # Between the LP's bound and the least plan found: no plan known.
            self._raise_infeasible(budget)
        return min(fitting, key=lambda x: float(cost @ x)), "LP dive", bound

    def _cutoff(self, model: _Model, budget: float) -> float | None:
        """The LP objective a dive at ``budget`` must stay under to beat the
        best plan known to fit it by more than the MIP gap (None: none known)."""
        cost = model.cost()
        known = [float(cost @ x) for peak, x in self._fitting if peak <= budget]
        if not known:
            return None
        best = min(known) + float(model.lp.offset_)
        return best - self.mip_rel_gap * abs(best)

    def _dive(self, model: _Model, h: highspy.Highs, x: np.ndarray,
              cutoff: float | None = None) -> np.ndarray | None:
        """A plan from the LP relaxation by diving: fix the fractional
        root whose leading strategy has the largest value to that strategy,
        solve the LP again (warm), and go on until it is integral; a fix that
        makes the LP infeasible is undone and the root's next strategy tried.
        The relaxation's bounds are restored afterwards. None: no plan.
        ``cutoff``: an LP objective at or over which the dive cannot beat a
        plan already known by more than the MIP gap; fixes that reach it fail
        like infeasible ones, as soon as the dual simplex passes it (GPT-2
        small on (2,2,4) at 0.5x: the 3.4 GiB rung's dive took 7.9 s to find
        the 2.7 GiB rung's plan again)."""
        if cutoff is not None:
            if float(h.getInfo().objective_function_value) >= cutoff:
                return None
            h.setOptionValue("objective_bound", cutoff)
        try:
            return self._fixings(model, h, x)
        finally:
            if cutoff is not None:
                h.setOptionValue("objective_bound", model.objective_ceiling())

    def _fixings(self, model: _Model, h: highspy.Highs, x: np.ndarray) -> np.ndarray | None:
        """``_dive``'s loop of fixes."""
        fixed: list[np.ndarray] = []
        found, failures, slowest_s = None, 0, 0.0
        for _ in range(_DIVE_STEPS):
            candidates = []
            for r, c in model.cols.items():
                v = x[c]
                if np.any(np.minimum(np.abs(v), np.abs(1 - v)) > _INTEGRAL):
                    candidates.append((float(v.max()), r))
            if not candidates:
                found = x
                break
            _, r = max(candidates)
            c = model.cols[r]
            for j in np.argsort(-x[c])[:_DIVE_TRIES]:
                if x[c][j] <= _INTEGRAL:
                    break
                lower = np.zeros(len(c))
                lower[j] = 1.0
                h.changeColsBounds(len(c), c.astype(np.int32), lower, np.ones(len(c)))
                start = time.perf_counter()
                self._run(h, seconds=max(DIVE_STEP_MIN_S, DIVE_STEP_FACTOR * slowest_s))
                if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
                    slowest_s = max(slowest_s, time.perf_counter() - start)
                    fixed.append(c)
                    x = np.asarray(h.getSolution().col_value)
                    break
                h.changeColsBounds(len(c), c.astype(np.int32), np.zeros(len(c)), np.ones(len(c)))
                failures += 1
                if failures > _DIVE_FAILURES:
                    break
            else:
                break
            if not fixed or fixed[-1] is not c:
                break  # no strategy of the root keeps the LP feasible
        for c in fixed:
            h.changeColsBounds(len(c), c.astype(np.int32), np.zeros(len(c)), np.ones(len(c)))
        h.clearSolver()  # a dive's last basis made the next solve 30x slower
        return found

    def _lagrangian_solution(self, model: _Model, cost: np.ndarray):
        """The plan of the LP without the budget rows under ``cost`` (integral,
        as the unconstrained LP is) and its peak in budget units (the largest
        budget row's activity over its bound); inf when not integral."""
        if model.lagrangian is None:
            h = _load(model.lp, self.time_limit_s, self.mip_rel_gap, relax=True)
            rows = model.limit_rows.astype(np.int32)
            h.changeRowsBounds(len(rows), rows, np.full(len(rows), -highspy.kHighsInf),
                               np.full(len(rows), highspy.kHighsInf))
            h.changeColBounds(model.budget_col, 0.0, 0.0)
            model.lagrangian = h
        h = model.lagrangian
        n = model.lp.num_col_
        h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
        self._run(h)
        solution = h.getSolution()
        x = np.asarray(solution.col_value)
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal or not model.integral(x):
            return x, float("inf")
        rows = np.asarray(solution.row_value)[model.limit_rows]
        return x, float(np.max(rows - model.limit_uppers())) if len(rows) else 0.0

    def _raise_infeasible(self, budget: float):
        smallest = self._least_bytes if self._least_bytes is not None else float("nan")
        known = np.isfinite(smallest)
        raise InfeasibleBudgetError(
            f"no plan fits a memory budget of {budget:.4g} bytes per device; "
            + (f"the smallest feasible budget is about {smallest:.4g} bytes "
               f"({smallest / 2**30:.3f} GiB). " if known else "")
            + "Raise the budget, use a larger mesh, or enable activation checkpointing.",
            smallest_feasible_budget_bytes=int(np.ceil(smallest)) if known else None,
        )

    def _start(self, model: _Model, h: highspy.Highs, budget: float) -> None:
        """Give branch and bound the fastest known plan that fits ``budget``
        as its first incumbent."""
        cost = model.cost()
        fitting = [x for peak, x in self._fitting if peak <= budget]
        if not fitting:
            return
        x = min(fitting, key=lambda x: float(cost @ x)).copy()
        x[model.budget_col] = budget / model.mem_unit
        start = highspy.HighsSolution()
        start.col_value = x
        h.setSolution(start)

    def _least(self, model: _Model) -> float:
        """The least budget a plan fits: the memory rows' budget variable
        freed and minimised. For large models its LP relaxation gives a lower
        bound (below it, nothing fits: ``_least_bound_bytes``) and a plan an
        upper bound, returned: the Lagrangian LP's with the least-budget LP's
        dual prices as costs, else a dive in that LP. The plan is kept, so a
        solve at the budget returned finds it."""
        lp = model.lp
        n = lp.num_col_
        relaxed = self._least_relaxation(model)
        if relaxed.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return float("nan")
        if self._exact(model):
            # Exactly (not within mip_rel_gap): the least budget an error names
            # must not depend on the search that led there.
            h = _load(lp, self.time_limit_s, 1e-6, relax=False)
            cost = np.zeros(n)
            cost[model.budget_col] = 1.0
            # Among plans of least peak, the one of least compute: a tie-break
            # that does not depend on the links (step times do: plans of least
            # time among those of least peak kept a least checkpointed budget
            # that moved with the link speed). It moves the least by < w.
            compute = self._compute_cost(model)
            if compute.any():
                bound_units = self._least_bound_bytes / model.mem_unit
                cost += LEAST_TIE_WEIGHT * bound_units * compute / compute.sum()
            h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
            h.changeColBounds(model.budget_col, 0.0, highspy.kHighsInf)
            if self._run(h) != highspy.HighsModelStatus.kOptimal:
                return float("nan")
            plan = np.asarray(h.getSolution().col_value)
            least = float(plan[model.budget_col]) * model.mem_unit
            self._least_bound_bytes = max(self._least_bound_bytes,
                                          least * (1 - LEAST_TIE_WEIGHT) * (1 - 1e-7))
            self._fitting.append((self._peak(model, plan), plan))
            self._least_plan = plan
            return least
        h = relaxed
        least = float(h.getInfo().objective_function_value) * model.mem_unit
        solution = h.getSolution()
        x = np.asarray(solution.col_value)
        if model.integral(x):
            return least
        prices = model.dual_prices(np.asarray(solution.row_dual))
        # Memory first, time to break ties.
        plan, peak_units = self._lagrangian_solution(model, prices * _US * 1e3 + model.cost())
        if not np.isfinite(peak_units):
            plan = self._dive(model, h, x)
        if plan is None:
            return float("nan")
        peak = self._peak(model, plan)
        self._fitting.append((peak, plan))
        self._least_plan = plan
        return max(peak, least)

    def _network(self, question: tuple):
        """The flow network of an edge's conversions (``conversion_network``)
        where it has fewer arcs and specs than the transport block has pair
        variables and rows; None where it does not (kept per question)."""
        if question not in self._networks:
            ua, _, ub, _, r = self._edge_specs[question]
            net = conversion_network(self.table.mesh, list(ua), list(ub), question[2],
                                     question[3])
            smaller = len(net.arc_cost_s) + net.num_specs < r.size + len(ua) + len(ub)
            self._networks[question] = net if smaller else None
        return self._networks[question]

    def _coupling(self, question: tuple, shard_count) -> ClassCoupling:
        """The shard-count classes of an edge's specs (kept per question)."""
        if question not in self._couplings:
            ua, _, ub, _, _ = self._edge_specs[question]
            self._couplings[question] = class_coupling(
                np.array([float(shard_count(s)) for s in ua]),
                np.array([float(shard_count(s)) for s in ub]), list(ua), list(ub))
        return self._couplings[question]

    def _compute_cost(self, model: _Model) -> np.ndarray:
        """Per column, the compute seconds (no communication: they do not
        depend on the links) its strategy costs, depth-weighted."""
        cost = np.zeros(model.lp.num_col_)
        nodes, nw = self.table.nodes, self.node_weight
        for r, vs in self.members.items():
            if r in model.cols:
                cost[model.cols[r]] = sum(nodes[v].compute_s[self.index[v]] * nw.get(v, 1.0)
                                          for v in vs)
        return cost

    def _peak(self, model: _Model, x: np.ndarray) -> float:
        return estimate_memory(self.table, self._choice(model, x), model.line, self.optimizer,
                               self.node_weight).peak_bytes

    def _choice(self, model: _Model, x: np.ndarray) -> dict[str, int]:
        cols = model.cols
        root_choice = {r: (int(np.argmax(x[cols[r]])) if r in cols else 0)
                       for r in self.members}
        return {v: int(self.index[v][root_choice[self.root[v]]]) for v in self.table.nodes}

    def _build(self, memory_budget_bytes: float | None) -> _Model:
        """The formulation, with the memory rows when a budget is given (their
        coefficients in units of that first budget, so the rows are O(1))."""
        start = time.perf_counter()
        table, root, index, members = self.table, self.root, self.index, self.members
        b = _Builder()
        nodes = table.nodes
        nw, ew = self.node_weight, self.edge_weight
        group_cost = {r: sum(nodes[v].time_s[index[v]] * nw.get(v, 1.0) for v in vs)
                      for r, vs in members.items()}
        cols: dict[str, np.ndarray] = {}
        constant_s = 0.0
        ceiling = _Ceiling()
        memory = _MemoryRows(table, self.optimizer) if memory_budget_bytes else None
        # Edges first (they may fold costs into node costs).
        edge_blocks: dict[tuple, list] = {}
        # Conversions into an input the op writes cannot run (the write would go
        # to a copy): such strategy choices are excluded (their columns' upper
        # bound 0; a price alone let a tight budget buy one), unless nothing
        # else is left, where the price still makes them a last resort.
        banned: dict[str, np.ndarray] = {}
        banned_pairs: dict[tuple, np.ndarray] = {}
        for producer, o, consumer, k in table.edges():
            ru, rv = root[producer], root[consumer]
            a_specs = [nodes[producer].out_specs[i][o] for i in index[producer]]
            b_specs = [nodes[consumer].in_specs[i][k] for i in index[consumer]]
            if ru == rv and a_specs == b_specs:
                continue  # a follower reads its producer's output as it is
            info = nodes[producer].outputs[o]
            question = (tuple(a_specs), tuple(b_specs), info.shape, info.dtype_bytes)
            known = self._edge_specs.get(question)
            if known is None:
                ua, a_idx = np.unique(a_specs, return_inverse=True)
                ub, b_idx = np.unique(b_specs, return_inverse=True)
                known = self._edge_specs[question] = (
                    ua, a_idx, ub, b_idx, resharding_cost_matrix(
                        table.mesh, list(ua), list(ub), info.shape, info.dtype_bytes))
            ua, a_idx, ub, b_idx, r = known
            r = r * ew.get((producer, o, consumer, k), 1.0)
            forbid = None
            if k in nodes[consumer].written_inputs or (k == 0 and _in_place(nodes[consumer].op)):
                # The op writes into this input: it must arrive as produced.
                forbid = ua[:, None] != ub[None, :]
                r = np.where(forbid, r + _FORBIDDEN_S, r)
                if not forbid.any():
                    forbid = None
            mem = None
            if memory is not None and consumer in memory.line.position:
                edge = (producer, o, consumer, k)
                kind = nodes[producer].kind
                # A function of these alone but for a user input's (its reader's
                # saved bytes): asked once per distinct question.
                asked = None if kind == "input" else (
                    question, kind, edge in memory.line.saved_copy_edges)
                if asked is None or asked not in self._edge_memory:
                    mem = edge_memory(table, memory.line, edge, list(ua), list(ub),
                                      memory.shard_count)
                    if not any(m.any() for m in mem):
                        mem = None
                    if asked is not None:
                        self._edge_memory[asked] = mem
                else:
                    mem = self._edge_memory[asked]
            key = None
            if ru == rv:
                group_cost[ru] = group_cost[ru] + r[a_idx, b_idx]
                _ban(banned, ru, forbid, a_idx, b_idx)
            elif not r.any():
                pass
            elif len(ua) == 1 and len(ub) == 1:
                constant_s += float(r[0, 0])
            elif len(ua) == 1:
                group_cost[rv] = group_cost[rv] + r[0, b_idx]
                _ban(banned, rv, forbid, 0, b_idx)
            elif len(ub) == 1:
                group_cost[ru] = group_cost[ru] + r[a_idx, 0]
                _ban(banned, ru, forbid, a_idx, 0)
            else:
                # Tied instances repeat the same edge: one block, costs summed.
                key = (ru, rv, a_idx.tobytes(), b_idx.tobytes())
                w = ew.get((producer, o, consumer, k), 1.0)
                if key in edge_blocks:
                    edge_blocks[key][4] += r
                    if edge_blocks[key][5] is not None and edge_blocks[key][5][0] == question:
                        edge_blocks[key][5][1] += w
                    else:
                        edge_blocks[key][5] = None
                else:
                    edge_blocks[key] = [ru, a_idx, rv, b_idx, r, [question, w]]
                if forbid is not None:
                    banned_pairs[key] = banned_pairs.get(key, False) | forbid
            if mem is not None:
                memory.edge_terms.append((consumer, ru, a_idx, rv, b_idx, key, mem))

        for r in members:
            if len(nodes[r]) > 1:
                cols[r] = b.columns(group_cost[r], integer=True, upper=_allowed(banned.get(r)))
                ceiling.choice(cols[r], group_cost[r], _allowed(banned.get(r)))
                row = b.rows(1.0, 1.0)
                b.entries(np.repeat(row, len(nodes[r])), cols[r], 1.0)
            else:
                constant_s += float(group_cost[r][0])

        num_edge_vars = pairs_replaced = 0
        edge_cols: dict[tuple, np.ndarray] = {}
        #: Flow edge blocks under a budget: id of each memory matrix -> its
        #: coefficients on the block's class-coupling columns.
        couplings: dict[tuple, dict[int, np.ndarray]] = {}
        memory_of: dict[tuple, list] = {}  # edge block -> its memory matrices
        for term in (memory.edge_terms if memory is not None else ()):
            if term[5] is not None:
                memory_of.setdefault(term[5], []).extend(m for m in term[6] if m.any())
        flows = self.edge_formulation == "flow-memory" or (
            self.edge_formulation == "flow" and memory is None)
        for key, (producer, a_idx, consumer, b_idx, r, flow) in edge_blocks.items():
            na, nb = r.shape
            net = coupling = None
            if flows and flow is not None and key not in banned_pairs:
                net = self._network(flow[0])
            coefs = None
            if net is not None and key in memory_of:
                coupling = self._coupling(flow[0], memory.shard_count)
                flow_columns = (len(net.arc_cost_s) + coupling.num_a * coupling.num_b
                                + len(coupling.same_a))
                if flow_columns * BUDGETED_FLOW_SHRINK <= r.size:
                    coefs = {id(m): coupling.coefficients(m) for m in memory_of[key]}
                if coefs is None or any(c is None for c in coefs.values()):
                    net = None  # a small block, or buffers that depend on the specs
            if net is not None:
                flow_vars = add_flow_edge(b, net, flow[1], cols[producer], a_idx,
                                          cols[consumer], b_idx)
                # The cheapest flow between two specs costs their conversion.
                ceiling.choice(np.arange(b.ncol - flow_vars, b.ncol), r, 1.0)
                if coupling is not None:
                    edge_cols[key] = add_class_coupling(b, coupling, cols[producer], a_idx,
                                                        cols[consumer], b_idx)
                    couplings[key] = coefs
                    flow_vars += len(edge_cols[key])
                num_edge_vars += flow_vars
                pairs_replaced += r.size - flow_vars
                continue
            ecols = b.columns(r.ravel(), integer=False, upper=_allowed(banned_pairs.get(key)))
            ceiling.choice(ecols, r.ravel(), _allowed(banned_pairs.get(key)))
            edge_cols[key] = ecols
            num_edge_vars += len(ecols)
            grid_a = np.repeat(np.arange(na), nb)
            grid_b = np.tile(np.arange(nb), na)
            rows_a = b.rows(np.zeros(na), np.zeros(na))
            b.entries(rows_a[grid_a], ecols, 1.0)
            b.entries(rows_a[a_idx], cols[producer], -1.0)
            rows_b = b.rows(np.zeros(nb), np.zeros(nb))
            b.entries(rows_b[grid_b], ecols, 1.0)
            b.entries(rows_b[b_idx], cols[consumer], -1.0)

        _shared_gradient_terms(b, table, root, index, cols, nw, ceiling)

        # Tied parameters choose the same spec.
        for name, node in nodes.items():
            if node.tied_to and root[name] in cols and root[node.tied_to] in cols:
                n = len(node)
                rows = b.rows(np.zeros(n), np.zeros(n))
                b.entries(rows, cols[root[name]], 1.0)
                b.entries(rows, cols[root[node.tied_to]], -1.0)

        budget_col = None
        floor = least_held_bytes(table, nw, index)
        mem_unit = _memory_unit(floor, memory_budget_bytes)
        if memory is not None:
            budget_col = memory.build(b, members, root, index, cols, edge_cols, couplings, nw,
                                      mem_unit,
                                      MEMORY_QUANTUM * max(1.0, floor))
        lp = b.lp()
        costliest_s = ceiling.total_s(np.asarray(lp.col_cost_)) + constant_s
        # Costs in microseconds: HiGHS's tolerances are absolute, step times small.
        lp.col_cost_ = np.asarray(lp.col_cost_) * _US
        return _Model(lp, cols, constant_s, budget_col, mem_unit, time.perf_counter() - start,
                      sum(len(c) for c in cols.values()), num_edge_vars,
                      memory.line if memory is not None else timeline(table),
                      np.array(memory.limit_rows if memory is not None else [], dtype=np.int64),
                      b.nonzeros, lp.num_col_ + pairs_replaced, costliest_plan_s=costliest_s)


#: Memory coefficients are rounded up to multiples of this share of the least
#: bytes the state and inputs hold (a property of the table, not of the
#: budget, so the least budget does not move with the first budget asked):
#: scalars' and small tensors' bytes put coefficients of 1e-9 budget units
#: into the rows, and HiGHS's dual simplex, warm from a dive's basis, then
#: took bad basis changes for 2,766 iterations and 103 s (GPT-2 small on
#: (2,2,2) at 0.7x; its time limit is checked too rarely to stop it).
#: Rounding up keeps the rows an upper bound of the memory model.
MEMORY_QUANTUM = 1e-6


def _units(coef: np.ndarray, unit: float, quantum_bytes: float) -> np.ndarray:
    """``coef`` bytes in budget units of ``unit`` bytes, rounded up to a
    multiple of ``quantum_bytes`` (a negative coefficient, memory freed,
    towards zero)."""
    return np.ceil(np.asarray(coef, dtype=np.float64) / quantum_bytes) * quantum_bytes / unit


def _memory_unit(floor_bytes: float, budget: float | None) -> float:
    """The bytes one unit of the memory rows stands for: the first budget, so
    that the rows are O(1), but never less than the least bytes the state and
    inputs hold (a lower bound on every feasible budget). A first solve at a
    tiny budget (``_leanest`` asks for 1 byte to learn the least) otherwise
    put coefficients of 1e11 into the rows: HiGHS then called the least-budget
    LP unknown and its MIP infeasible, and no least budget was found (GPT-3
    76B on 2x8). ``floor_bytes``: ``memory.least_held_bytes``."""
    return max(float(budget or 0.0), floor_bytes, 1.0)


def _shared_gradient_terms(b: _Builder, table: StrategyTable, root, index, cols, nw,
                           ceiling: _Ceiling) -> None:
    """Take back the gradient all-reduces that readers of one tensor share
    (``solve/shared_gradients.py``): each reader's strategy prices its own. Per
    produced tensor, spec t and mesh axes A read by several readers: per reader a
    variable f <= [it reads t reducing over A] and f <= [the producer makes t],
    priced minus one all-reduce, and z >= every f, priced one all-reduce. The
    minimum sets f to the AND and z to the OR, so a group pays one all-reduce."""
    nodes = table.nodes
    shard_count = ShardCounts(table.mesh)
    readers: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for producer, o, consumer, k in table.edges():
        if nodes[producer].kind not in UNSHARED_KINDS and nodes[consumer].reductions is not None:
            readers.setdefault((producer, o), []).append((consumer, k))

    def at_most(f: int, node: str, columns: np.ndarray) -> bool:
        """f <= the sum of ``node``'s choice over ``columns``; False: never chosen."""
        r = root[node]
        if r not in cols:  # one strategy: chosen
            return bool(len(columns))
        row = b.rows(-np.inf, 0.0)
        b.entries(np.repeat(row, len(columns) + 1), np.concatenate(([f], cols[r][columns])),
                  np.concatenate(([1.0], -np.ones(len(columns)))))
        return True

    for (producer, o), reads in readers.items():
        if len(reads) < 2:
            continue
        made = np.array([nodes[producer].out_specs[i][o] for i in index[producer]])
        groups: dict[tuple, dict[tuple[str, int], list[int]]] = {}
        for consumer, k in reads:
            c = nodes[consumer]
            for j, i in enumerate(index[consumer]):
                grads = c.reductions[i][2]
                axes = tuple(grads[k]) if k < len(grads) else ()
                if axes:
                    key = (c.in_specs[i][k], axes)
                    groups.setdefault(key, {}).setdefault((consumer, k), []).append(j)
        for (spec, axes), by_reader in groups.items():
            made_cols = np.flatnonzero(made == spec)
            if len(by_reader) < 2 or not len(made_cols):
                continue
            # Depth weights: the least of the readers' (never over-credits).
            weight = min(nw.get(c, 1.0) for c, _ in by_reader)
            local = nodes[producer].outputs[o].nbytes / shard_count(spec)
            cost = weight * table.mesh.all_reduce_cost_s(local, axes)
            z = b.columns([cost], integer=False)[0]
            ceiling.choice(np.array([z]), np.array([cost]), 1.0)  # the OR: at most 1
            for (consumer, _), js in by_reader.items():
                f = b.columns([-cost], integer=False)[0]
                if not (at_most(f, consumer, np.array(js)) and at_most(f, producer, made_cols)):
                    b.upper[-1][0] = 0.0  # that reader never shares: f stays 0
                    continue
                row = b.rows(0.0, np.inf)
                b.entries(np.repeat(row, 2), np.array([z, f]), np.array([1.0, -1.0]))


class _Ceiling:
    """The costliest plan's objective, summed per choice as it is built: a
    node's strategies, an edge's conversions (its spec pairs, or the flow
    between them, whose cheapest route costs the pair's conversion) and the
    shared all-reduces (each at most once). Columns it does not know, priced
    above 0, leave it unknown (inf); credits (costs under 0) only lower a plan's."""

    def __init__(self) -> None:
        self.costliest_s = 0.0
        self.known: list[np.ndarray] = []

    def choice(self, columns: np.ndarray, cost_s, upper) -> None:
        """One option of ``cost_s`` (per option; ``upper`` 0 where not allowed) is chosen."""
        cost_s = np.ravel(np.asarray(cost_s, dtype=float))
        allowed = np.broadcast_to(np.asarray(upper) > 0, cost_s.shape)
        self.costliest_s += max(0.0, float(cost_s[allowed].max())) if allowed.any() else 0.0
        self.known.append(np.asarray(columns))

    def total_s(self, cost_s: np.ndarray) -> float:
        known = np.zeros(len(cost_s), dtype=bool)
        if self.known:
            known[np.concatenate(self.known).astype(np.int64)] = True
        return self.costliest_s if not np.any(cost_s[~known] > 0) else math.inf


class _MemoryRows:
    """The rows of ``automap.solve.memory``'s model, bounded by the budget: a
    variable for the state and inputs, running sums of the bytes saved up to each
    node and of the gradients (and bucket copies) from each node on, and a row
    for the forward and the backward of every node where memory changes, plus
    one for the optimizer step. The budget is a variable fixed to its value, so
    that the least feasible budget is the same model with it freed and minimised."""

    def __init__(self, table: StrategyTable, optimizer: str) -> None:
        self.table = table
        self.line = timeline(table)
        self.shard_count = ShardCounts(table.mesh)
        self.opt_of_largest, self.opt_of_all = optimizer_temporaries(optimizer,
                                                                     table.optimizer_impl)
        # What a for-loop step still holds of the shard it stepped before.
        self.opt_carry = loop_carry(optimizer, table.optimizer_impl)
        # (consumer, producer root, a_idx, consumer root, b_idx, edge block key, matrices)
        self.edge_terms: list[tuple] = []
        self._terms: dict[tuple, int] = {}  # distinct term -> its variable
        self.limit_rows: list[int] = []  # the rows bounded by the budget

    def build(self, b: _Builder, members, root, index, cols, edge_cols, couplings, nw, unit,
              quantum_bytes) -> int:
        nodes, line = self.table.nodes, self.line
        n = len(line)
        kinds = ("saved", "later", "waiting", "fwd", "bwd", "after", "own")
        terms = {k: [[] for _ in range(n)] for k in kinds}
        consts = {k: np.zeros(n) for k in kinds}
        base, grads, opt = [], [], []
        base_const = grad_const = opt_const = 0.0
        before = None  # the trained parameter the optimizer steps before this one: (root, coef)

        def units(coef) -> np.ndarray:
            return _units(coef, unit, quantum_bytes)

        def add(kind, i, r, coef):
            if r in cols:
                terms[kind][i].append(self._shared(b, cols[r], units(coef)))
            else:
                consts[kind][i] += float(units(coef[0]))

        for v, node in nodes.items():
            r, idx, w = root[v], index[v], nw.get(v, 1.0)
            held = (node.state_bytes + node.input_bytes)[idx] * w
            if held.any():
                if r in cols:
                    base.append((cols[r], units(held)))
                else:
                    base_const += float(units(held[0]))
            if node.kind == "parameter" and node.grad_bytes.any():
                g = node.grad_bytes[idx]
                add("later", line.grad_position[v], r, g * w)
                if r in cols:
                    grads.append((cols[r], units(g * w)))
                else:
                    grad_const += float(units(g[0] * w))
                if self.opt_of_largest:
                    # The for-loop step's temporaries of this shard beside what
                    # it holds of the one before (``memory.loop_temps``).
                    stepping = {r: self.opt_of_largest * g}
                    if before is not None and self.opt_carry:
                        held_r, held = before
                        stepping[held_r] = stepping.get(held_r, 0.0) + self.opt_carry * held
                    parts = [(cols[q], units(coef)) for q, coef in stepping.items() if q in cols]
                    const = sum(float(units(coef[0])) for q, coef in stepping.items()
                                if q not in cols)
                    if len(stepping) == 1 and parts:
                        # One shard alone: a row per strategy (the LP's maximum,
                        # not its average, of the strategies' fractions).
                        (c, coef), = parts
                        opt.extend(([(c[j:j + 1], coef[j:j + 1])], 0.0) for j in range(len(c)))
                    elif parts:
                        opt.append((parts, const))
                    else:
                        opt_const = max(opt_const, const)
                before = (r, g)
            i = line.position.get(v)
            if i is None:
                continue
            if v in line.last_reader:  # its output's gradient waits for its backward
                g = np.array([waiting_gradient_bytes(node, j, self.shard_count) for j in idx])
                add("waiting", line.last_reader[v] - 1, r, g * w)
                if i > 0:
                    add("waiting", i - 1, r, -g * w)
                add("own", i, r, -g * w)  # its kernels use it up
            for kind, column, weight in (("saved", node.saved_bytes, w),
                                         ("later", node.bucket_bytes, w),
                                         ("fwd", node.fwd_transient_bytes, 1.0),
                                         ("bwd", node.bwd_transient_bytes, 1.0),
                                         ("after", node.bwd_after_bytes, 1.0)):
                coef = column[idx] * weight
                if coef.any():
                    add(kind, i, r, coef)
        for consumer, ru, a_idx, rv, b_idx, key, matrices in self.edge_terms:
            i = line.position[consumer]
            w = nw.get(consumer, 1.0)
            for kind, matrix in zip(("fwd", "bwd", "after", "saved"), matrices):
                if not matrix.any():
                    continue
                m = matrix * w if kind == "saved" else matrix
                if ru == rv:
                    add(kind, i, ru, m[a_idx, b_idx])
                elif key in couplings:  # flow edges: buffers by shard-count class
                    coef = couplings[key][id(matrix)] * (w if kind == "saved" else 1.0)
                    terms[kind][i].append(self._shared(b, edge_cols[key], units(coef)))
                elif key is not None:
                    terms[kind][i].append(self._shared(b, edge_cols[key], units(m.ravel())))
                elif m.shape == (1, 1):
                    consts[kind][i] += float(units(m[0, 0]))
                elif m.shape[0] == 1:
                    add(kind, i, rv, m[0, b_idx])
                elif m.shape[1] == 1:
                    add(kind, i, ru, m[a_idx, 0])
                else:  # a conversion that costs no time (a split): its worst case
                    add(kind, i, rv, m.max(axis=0)[b_idx])

        inf = highspy.kHighsInf
        budget = b.columns([0.0], integer=False, upper=inf)[0]
        total = b.columns([0.0], integer=False, upper=inf)[0]  # state + inputs
        self._sum(b, total, base, base_const)

        def running(kind, order):
            """The running sum of ``kind`` over positions in ``order``: its variable
            at each position (None while it is zero)."""
            current, out = None, [None] * n
            for i in order:
                if terms[kind][i] or consts[kind][i]:
                    var = b.columns([0.0], integer=False, upper=inf)[0]
                    parts = list(terms[kind][i])
                    if current is not None:
                        parts.append((np.array([current]), np.array([1.0])))
                    self._sum(b, var, parts, consts[kind][i])
                    current = var
                out[i] = current
            return out

        kept = running("saved", range(n))
        later = running("later", range(n - 1, -1, -1))
        waiting = running("waiting", range(n - 1, -1, -1))

        def row(parts, const):
            r = b.rows(-inf, -const)[0]
            self.limit_rows.append(r)
            for c, coef in parts:
                b.entries(np.full(len(c), r), c, coef)
            b.entries([r], [total], 1.0)
            b.entries([r], [budget], -1.0)

        for i in range(n):
            prev = kept[i - 1] if i else None
            if terms["fwd"][i] or consts["fwd"][i]:
                row(terms["fwd"][i] + _var(prev), consts["fwd"][i])
            changes = any(terms[k][i] or consts[k][i] for k in ("saved", "later", "waiting", "bwd"))
            if changes:
                row(terms["bwd"][i] + _var(kept[i]) + _var(later[i]) + _var(waiting[i]),
                    consts["bwd"][i])
            # After its kernels: what the node saved is freed, its input
            # gradients are reduced and converted back.
            if terms["after"][i] or consts["after"][i]:
                row(terms["after"][i] + terms["own"][i] + _var(prev) + _var(later[i])
                    + _var(waiting[i]), consts["after"][i] + consts["own"][i])
        # The optimizer step: every gradient and the temporaries, the largest
        # shard's (for-loop kernels: ``opt_temp``) or every shard's (foreach:
        # in proportion to the gradients, shaped as their parameters).
        grad_total = b.columns([0.0], integer=False, upper=inf)[0]
        self._sum(b, grad_total, grads, grad_const)
        opt_temp = b.columns([0.0], integer=False, upper=inf)[0]
        for parts, const in opt:
            r = b.rows(const, inf)[0]
            b.entries([r], [opt_temp], 1.0)
            for c, coef in parts:
                b.entries(np.full(len(c), r), c, -coef)
        r = b.rows(-inf, -opt_const)[0]
        self.limit_rows.append(r)
        b.entries([r, r, r, r], [total, grad_total, opt_temp, budget],
                  [1.0, 1.0 + self.opt_of_all, 1.0, -1.0])
        return budget

    def _shared(self, b: _Builder, cols: np.ndarray, coef: np.ndarray):
        """The term ``coef . cols`` as one variable, made once per distinct
        term: a tied block's instances put the same term into a row at each
        instance (12 copies of every edge block in GPT-2), which made the
        memory rows hold 3.2 M of the budgeted model's 3.6 M nonzeros."""
        if len(cols) <= _SHARE_ABOVE:
            return cols, coef
        key = (int(cols[0]), len(cols), coef.tobytes())
        var = self._terms.get(key)
        if var is None:
            var = b.columns([0.0], integer=False, upper=highspy.kHighsInf,
                            lower=-highspy.kHighsInf)[0]
            self._sum(b, var, [(cols, coef)], 0.0)
            self._terms[key] = var
        return np.array([var]), np.array([1.0])

    @staticmethod
    def _sum(b: _Builder, var: int, parts, const: float) -> None:
        """``var = Σ parts + const``."""
        r = b.rows(const, const)[0]
        b.entries([r], [var], 1.0)
        for c, coef in parts:
            b.entries(np.full(len(c), r), c, -coef)


def _var(col: int | None) -> list:
    return [] if col is None else [(np.array([col]), np.array([1.0]))]


_US = 1e6
#: Memory-row terms over more columns than this get a variable of their own.
_SHARE_ABOVE = 4
#: Price of a conversion the generator cannot run (into an in-place op's
#: mutated input): the solver takes one only when nothing else exists.
_FORBIDDEN_S = 1e3


def _ban(banned: dict, root: str, forbid, a, b) -> None:
    """Note which of ``root``'s strategies pick a forbidden pair of ``forbid``
    (producer spec ``a``, consumer spec ``b``, per strategy)."""
    if forbid is not None:
        banned[root] = banned.get(root, False) | forbid[a, b]


def _allowed(banned) -> np.ndarray | float:
    """Upper bounds of columns (``banned``: per column, or None): 0 where
    banned, unless every one is (the price alone then keeps them a last resort)."""
    if banned is None or not np.any(banned) or np.all(banned):
        return 1.0
    return np.where(np.ravel(banned), 0.0, 1.0)


def _in_place(op: str) -> bool:
    return op.endswith("_") and not op.startswith("_")


def _quiet(make):
    """``make()`` with the process's stdout silenced: HiGHS (1.16) prints its
    banner there when constructed, before any option can turn output off, and
    a user's stdout (e.g. JSON lines) must not carry it."""
    import ctypes
    import os
    import sys

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        return make()  # no file descriptor 1 to silence
    libc = ctypes.CDLL(None)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            made = make()
            libc.fflush(None)  # what C buffered goes to /dev/null too
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return made


def _highs(time_limit_s: float, mip_rel_gap: float) -> highspy.Highs:
    h = _quiet(highspy.Highs)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("threads", 1)
    return h
