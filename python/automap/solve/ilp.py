"""The intra-op ILP (MAP section 5.1, Alpa's formulation), solved with HiGHS.

- One binary per strategy of each node with a choice, one-hot per node.
- Edges: one continuous variable per pair of *distinct* specs on the two
  sides (producer output spec, consumer input spec), priced with the
  resharding cost, with marginal equalities to both sides' choices; that
  keeps the LP relaxation tight and the edge count far below strategy pairs.
  An edge with one distinct spec on a side folds into the other side's costs.
- Followers (single-input nodes) ride on their producer's choice unless
  ``merge_followers=False``: Alpa's reduction, far fewer variables.
- Repeated blocks (TAP) share the first instance's variables, so the
  problem does not grow with depth; boundary edges stay exact.
- Objective: estimated step time in seconds (compute + node collectives +
  conversions, forward and backward, + the optimizer step), every term in
  sequence (the reported prediction overlaps gradient buckets, see
  ``planner/step_time.py``).
- Memory: the rows of ``automap.solve.memory``'s model (the forward and the
  backward of every node where memory changes, and the optimizer step) must
  fit the budget; running sums keep the rows short.
Coefficients are gathered as numpy arrays per node and per edge, never one
Python call per coefficient.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import highspy
import numpy as np

from automap.errors import InfeasibleBudgetError, SolverTimeLimitError
from automap.sharding.layout import resharding_cost_matrix
from automap.solve.memory import (
    edge_memory,
    estimate_memory,
    optimizer_temp_factor,
    timeline,
    waiting_gradient_bytes,
)
from automap.solve.strategies import ShardCounts, StrategyTable


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
        self.rows_lo: list[float] = []
        self.rows_hi: list[float] = []
        self.entry_row: list[np.ndarray] = []
        self.entry_col: list[np.ndarray] = []
        self.entry_val: list[np.ndarray] = []

    def columns(self, cost, integer: bool, upper=1.0) -> np.ndarray:
        cost = np.asarray(cost, dtype=np.float64)
        n = len(cost)
        cols = np.arange(self.ncol, self.ncol + n)
        self.ncol += n
        self.cost.append(cost)
        self.lower.append(np.zeros(n))
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
        lp.col_cost_ = cost
        lp.col_lower_ = np.concatenate(self.lower)
        lp.col_upper_ = np.concatenate(self.upper)
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
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in np.concatenate(self.integer)]
        return lp


def solve_ilp(
    table: StrategyTable,
    memory_budget_bytes: float | None = None,
    *,
    time_limit_s: float = 60.0,
    mip_rel_gap: float = 1e-6,
    merge_followers: bool = True,
    blocks: list | None = None,
    node_weight: dict[str, float] | None = None,
    edge_weight: dict[tuple, float] | None = None,
    optimizer: str = "adamw",
) -> IlpSolution:
    """Choose one strategy per node minimising the estimated step time under
    the memory budget (None: unconstrained). ``merge_followers`` shrinks the
    problem by letting single-input nodes read their producer's output as is
    (a restriction: exact optimality needs it off). ``blocks`` (from
    ``automap.solve.blocks.detect_blocks``) ties every instance of a repeated block
    to the first: one set of variables, costs summed over the instances.
    ``node_weight`` and ``edge_weight`` say how often a node or an edge occurs
    in the real model (depth-reduced planning, see ``automap.solve.depth``)."""
    start = time.perf_counter()
    b = _Builder()
    nodes = table.nodes
    root, index = _groups(table, merge_followers, _tie_map(table, blocks or []))
    members: dict[str, list[str]] = {}
    for name in nodes:
        members.setdefault(root[name], []).append(name)
    # Per root, arrays over the root's strategies.
    nw = node_weight or {}
    ew = edge_weight or {}
    group_cost = {r: sum(nodes[v].time_s[index[v]] * nw.get(v, 1.0) for v in vs)
                  for r, vs in members.items()}
    cols: dict[str, np.ndarray] = {}
    constant_s = 0.0
    memory = _MemoryRows(table, optimizer) if memory_budget_bytes is not None else None

    # Edges first (they may fold costs into node costs).
    edge_blocks: dict[tuple, list] = {}
    for producer, o, consumer, k in table.edges():
        ru, rv = root[producer], root[consumer]
        a_specs = [nodes[producer].out_specs[i][o] for i in index[producer]]
        b_specs = [nodes[consumer].in_specs[i][k] for i in index[consumer]]
        if ru == rv and a_specs == b_specs:
            continue  # a follower reads its producer's output as it is
        ua, a_idx = np.unique(a_specs, return_inverse=True)
        ub, b_idx = np.unique(b_specs, return_inverse=True)
        info = nodes[producer].outputs[o]
        r = resharding_cost_matrix(table.mesh, list(ua), list(ub), info.shape, info.dtype_bytes)
        r = r * ew.get((producer, o, consumer, k), 1.0)
        if k == 0 and _in_place(nodes[consumer].op):
            # The op writes into this input: it must arrive as produced.
            r = np.where(ua[:, None] == ub[None, :], r, r + _FORBIDDEN_S)
        mem = None
        if memory is not None and consumer in memory.line.position:
            mem = edge_memory(table, memory.line, (producer, o, consumer, k), list(ua),
                              list(ub), memory.shard_count)
            if not any(m.any() for m in mem):
                mem = None
        key = None
        if ru == rv:
            group_cost[ru] = group_cost[ru] + r[a_idx, b_idx]
        elif not r.any():
            pass
        elif len(ua) == 1 and len(ub) == 1:
            constant_s += float(r[0, 0])
        elif len(ua) == 1:
            group_cost[rv] = group_cost[rv] + r[0, b_idx]
        elif len(ub) == 1:
            group_cost[ru] = group_cost[ru] + r[a_idx, 0]
        else:
            # Tied instances repeat the same edge: one block, costs summed.
            key = (ru, rv, a_idx.tobytes(), b_idx.tobytes())
            if key in edge_blocks:
                edge_blocks[key][4] += r
            else:
                edge_blocks[key] = [ru, a_idx, rv, b_idx, r]
        if mem is not None:
            memory.edge_terms.append((consumer, ru, a_idx, rv, b_idx, key, mem))

    for r in members:
        if len(nodes[r]) > 1:
            cols[r] = b.columns(group_cost[r], integer=True)
            row = b.rows(1.0, 1.0)
            b.entries(np.repeat(row, len(nodes[r])), cols[r], 1.0)
        else:
            constant_s += float(group_cost[r][0])

    num_edge_vars = 0
    edge_cols: dict[tuple, np.ndarray] = {}
    for key, (producer, a_idx, consumer, b_idx, r) in edge_blocks.items():
        na, nb = r.shape
        ecols = b.columns(r.ravel(), integer=False)
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

    # Tied parameters choose the same spec.
    for name, node in nodes.items():
        if node.tied_to and root[name] in cols and root[node.tied_to] in cols:
            n = len(node)
            rows = b.rows(np.zeros(n), np.zeros(n))
            b.entries(rows, cols[root[name]], 1.0)
            b.entries(rows, cols[root[node.tied_to]], -1.0)

    budget_col = None
    mem_unit = float(memory_budget_bytes) if memory_budget_bytes else 1.0
    if memory is not None:
        budget_col = memory.build(b, members, root, index, cols, edge_cols, nw, mem_unit)
    lp = b.lp()
    # Costs in microseconds: HiGHS's tolerances are absolute, step times small.
    lp.col_cost_ = np.asarray(lp.col_cost_) * _US
    if budget_col is not None:  # the budget is a fixed variable of the memory rows
        lower, upper = np.asarray(lp.col_lower_), np.asarray(lp.col_upper_)
        lower[budget_col] = upper[budget_col] = float(memory_budget_bytes) / mem_unit
        lp.col_lower_, lp.col_upper_ = lower, upper
    build_s = time.perf_counter() - start

    h = _highs(time_limit_s, mip_rel_gap)
    h.passModel(lp)
    h.run()
    solve_s = time.perf_counter() - start - build_s
    status = h.getModelStatus()
    info = h.getInfo()
    has_solution = info.primal_solution_status == 2  # feasible
    if status == highspy.HighsModelStatus.kInfeasible:
        smallest = _smallest_feasible_budget(lp, budget_col, mem_unit, time_limit_s)
        known = np.isfinite(smallest)
        raise InfeasibleBudgetError(
            f"no plan fits a memory budget of {memory_budget_bytes:.4g} bytes per device; "
            + (f"the smallest feasible budget is about {smallest:.4g} bytes "
               f"({smallest / 2**30:.3f} GiB). " if known else "")
            + "Raise the budget, use a larger mesh, or enable activation checkpointing.",
            smallest_feasible_budget_bytes=int(np.ceil(smallest)) if known else None,
        )
    if not has_solution:
        raise SolverTimeLimitError(
            f"HiGHS found no feasible plan within {time_limit_s} s "
            f"(status: {h.modelStatusToString(status)}); raise time_limit_s")
    x = np.asarray(h.getSolution().col_value)
    root_choice = {r: (int(np.argmax(x[cols[r]])) if r in cols else 0) for r in members}
    choice = {v: int(index[v][root_choice[root[v]]]) for v in nodes}
    line = memory.line if memory is not None else timeline(table)
    peak = estimate_memory(table, choice, line, optimizer, nw).peak_bytes
    binding = memory_budget_bytes is not None and peak >= 0.999 * float(memory_budget_bytes)
    return IlpSolution(
        choice=choice,
        objective_s=float(info.objective_function_value) / _US + constant_s,
        gap=float(info.mip_gap) if np.isfinite(info.mip_gap) else 0.0,
        status=h.modelStatusToString(status),
        peak_memory_bytes=peak,
        memory_binding=binding,
        build_s=build_s,
        solve_s=solve_s,
        num_binaries=sum(len(c) for c in cols.values()),
        num_edge_variables=num_edge_vars,
        num_rows=lp.num_row_,
    )


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
        self.opt_factor = optimizer_temp_factor(optimizer)
        # (consumer, producer root, a_idx, consumer root, b_idx, edge block key, matrices)
        self.edge_terms: list[tuple] = []

    def build(self, b: _Builder, members, root, index, cols, edge_cols, nw, unit) -> int:
        nodes, line = self.table.nodes, self.line
        n = len(line)
        kinds = ("saved", "later", "waiting", "fwd", "bwd")
        terms = {k: [[] for _ in range(n)] for k in kinds}
        consts = {k: np.zeros(n) for k in kinds}
        base, grads, opt = [], [], []
        base_const = grad_const = opt_const = 0.0

        def add(kind, i, r, coef):
            if r in cols:
                terms[kind][i].append((cols[r], coef / unit))
            else:
                consts[kind][i] += float(coef[0]) / unit

        for v, node in nodes.items():
            r, idx, w = root[v], index[v], nw.get(v, 1.0)
            held = (node.state_bytes + node.input_bytes)[idx] * w
            if held.any():
                if r in cols:
                    base.append((cols[r], held / unit))
                else:
                    base_const += float(held[0]) / unit
            if node.kind == "parameter" and node.grad_bytes.any():
                g = node.grad_bytes[idx]
                add("later", line.grad_position[v], r, g * w)
                if r in cols:
                    grads.append((cols[r], g * w / unit))
                    opt.append((cols[r], self.opt_factor * g / unit))
                else:
                    grad_const += float(g[0]) * w / unit
                    opt_const = max(opt_const, self.opt_factor * float(g[0]) / unit)
            i = line.position.get(v)
            if i is None:
                continue
            if v in line.last_reader:  # its output's gradient waits for its backward
                g = np.array([waiting_gradient_bytes(node, j, self.shard_count) for j in idx])
                add("waiting", line.last_reader[v] - 1, r, g * w)
                if i > 0:
                    add("waiting", i - 1, r, -g * w)
            for kind, column, weight in (("saved", node.saved_bytes, w),
                                         ("later", node.bucket_bytes, w),
                                         ("fwd", node.fwd_transient_bytes, 1.0),
                                         ("bwd", node.bwd_transient_bytes, 1.0)):
                coef = column[idx] * weight
                if coef.any():
                    add(kind, i, r, coef)
        for consumer, ru, a_idx, rv, b_idx, key, matrices in self.edge_terms:
            i = line.position[consumer]
            w = nw.get(consumer, 1.0)
            for kind, m in zip(("fwd", "bwd", "saved"), matrices):
                if not m.any():
                    continue
                if kind == "saved":
                    m = m * w
                if ru == rv:
                    add(kind, i, ru, m[a_idx, b_idx])
                elif key is not None:
                    terms[kind][i].append((edge_cols[key], m.ravel() / unit))
                elif m.shape == (1, 1):
                    consts[kind][i] += float(m[0, 0]) / unit
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
        # The optimizer step: every gradient and the largest shard's temporaries.
        grad_total = b.columns([0.0], integer=False, upper=inf)[0]
        self._sum(b, grad_total, grads, grad_const)
        opt_temp = b.columns([0.0], integer=False, upper=inf)[0]
        for c, coef in opt:
            rows = b.rows(np.zeros(len(c)), np.full(len(c), inf))
            b.entries(rows, np.full(len(c), opt_temp), 1.0)
            b.entries(rows, c, -coef)
        r = b.rows(-inf, -opt_const)[0]
        b.entries([r, r, r, r], [total, grad_total, opt_temp, budget], [1.0, 1.0, 1.0, -1.0])
        return budget

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
#: Price of a conversion the generator cannot run (into an in-place op's
#: mutated input): the solver takes one only when nothing else exists.
_FORBIDDEN_S = 1e3


def _in_place(op: str) -> bool:
    return op.endswith("_") and not op.startswith("_")


def _tie_map(table: StrategyTable, blocks) -> dict[str, str]:
    """Node of a later block instance -> the corresponding node of the first,
    where both have the same strategies (same shapes, same signature)."""
    tie: dict[str, str] = {}
    for block in blocks:
        first = block.instances[0]
        for instance in block.instances[1:]:
            for rep, name in zip(first, instance):
                a, b = table.nodes.get(rep), table.nodes.get(name)
                if (a is not None and b is not None and a.in_specs == b.in_specs
                        and a.out_specs == b.out_specs):
                    tie[name] = rep
    return tie


def _groups(table: StrategyTable, merge_followers: bool, tie: dict[str, str]):
    """Each node's root (the node whose variables decide it) and, per strategy
    of the root, the node's strategy. Tied block nodes take their first
    instance's; followers (Alpa's merging) take the strategy that reads their
    producer's output as it is: a node with one tensor input whose strategies
    differ only by that input's spec."""
    root: dict[str, str] = {}
    index: dict[str, np.ndarray] = {}
    for name, node in table.nodes.items():
        root[name], index[name] = name, np.arange(len(node))
        rep = tie.get(name)
        if rep is not None:
            root[name], index[name] = root[rep], index[rep]
            continue
        if (not merge_followers or len(node) < 2 or len(node.inputs) != 1
                or node.kind not in ("einsum", "view")):
            continue
        producer, o = node.inputs[0]
        by_spec: dict[str, int] = {}
        for t, specs in enumerate(node.in_specs):
            if specs[0] in by_spec:
                break
            by_spec[specs[0]] = t
        else:
            produced = [table.nodes[producer].out_specs[i][o] for i in index[producer]]
            if all(spec in by_spec for spec in produced):
                root[name] = root[producer]
                index[name] = np.array([by_spec[spec] for spec in produced])
    return root, index


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


def _smallest_feasible_budget(lp, budget_col, mem_unit, time_limit_s) -> float:
    """The least budget any plan fits: the memory rows' budget variable, freed
    and minimised."""
    cost = np.zeros(lp.num_col_)
    cost[budget_col] = 1.0
    lp.col_cost_ = cost
    lower, upper = np.asarray(lp.col_lower_), np.asarray(lp.col_upper_)
    lower[budget_col], upper[budget_col] = 0.0, highspy.kHighsInf
    lp.col_lower_, lp.col_upper_ = lower, upper
    h = _highs(time_limit_s, 1e-6)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return float("nan")
    return float(h.getInfo().objective_function_value) * mem_unit
