"""Plans with chosen specs, for tests that must exercise one way of
parallelising: the ILP solves as usual over strategy tables restricted by
per-node predicates (parameter specs, input specs, op strategies)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

import numpy as np

from automap.planner import search as planner
from automap.solve.strategies import restrict
from automap.trace.profiling import profile_traced
from automap.trace.tracing import default_loss, trace
from speeds import speeds

#: (input specs, output specs) of a strategy -> keep it?
Keep = Callable[[tuple, tuple], bool]


@contextlib.contextmanager
def _constrained(constraints: dict[str, Keep]):
    original = planner.build_strategy_table

    def keep(table, node):
        rule = constraints.get(node.name)
        if rule is None:
            return np.ones(len(node), dtype=bool)
        mask = [rule(node.in_specs[i], node.out_specs[i]) for i in range(len(node))]
        if not any(mask):
            raise ValueError(f"no strategy of {node.name} satisfies the constraint; it has "
                             f"{sorted(set(zip(node.in_specs, node.out_specs)))[:20]}")
        return np.array(mask)

    def build(*args, **kwargs):
        table = original(*args, **kwargs)
        restrict(table, keep)
        return table

    planner.build_strategy_table = build
    try:
        yield
    finally:
        planner.build_strategy_table = original


#: Input spec: split on dim 0 (the batch) over every mesh axis.
BATCH = "batch"


def output_is(spec: str) -> Keep:
    return lambda ins, outs: outs[0] == spec


def forced_plan(model, example_inputs, loss_fn, mesh, *, params: dict[str, str] | None = None,
                inputs: dict[str, str] | None = None, ops: dict[str, Keep] | None = None,
                flops_per_s: float = 1e6, mixed_precision=None, **options):
    """The ILP's plan with parameter specs forced (``params``: regex on the parameter
    name -> spec; unmatched parameters replicated when ``params`` is given), user
    input specs (input node name -> spec, or ``BATCH``) and op predicates (node name -> Keep).
    A slow ``flops_per_s`` makes splitting the compute worth its communication;
    ``options`` go to ``plan_traced`` (e.g. ``device``, a memory budget)."""
    traced = trace(model, example_inputs, loss_fn=loss_fn or default_loss,
                   mixed_precision=mixed_precision)
    constraints: dict[str, Keep] = {}
    if params is not None:
        for name, state in traced.parameters.items():
            spec = next((s for pattern, s in params.items() if re.search(pattern, name)),
                        "R" * len(state.shape))
            constraints[state.node] = output_is(spec)
    placeholders = {n.name: n for n in traced.graph.nodes if n.op == "placeholder"}
    for name, spec in (inputs or {}).items():
        if spec == BATCH:
            rank = placeholders[name].meta["val"].dim()
            spec = "S" + "".join(str(a) for a in range(mesh.ndim)) + "R" * (rank - 1)
        constraints[name] = output_is(spec)
    constraints.update(ops or {})
    with _constrained(constraints):
        options = {**speeds(flops_per_s), **options}  # every rank plans alike
        return traced, planner.plan_traced(traced, profile_traced(traced, "adamw"), mesh,
                                           **options)


def axis_1_outermost(table, node) -> np.ndarray:
    """A ``strategy_filter``: parameters split over both axes of a 2-D mesh only
    with axis 1 outermost (``S10``: DTensor's ``_StridedShard`` placements, which
    the checkpoint and placement tests are about; ``S01`` costs the same, and
    which of the two the solver picks moved with unrelated pricing changes)."""
    return np.array([node.kind != "parameter" or not any("01" in s for s in outs)
                     for outs in node.out_specs])
