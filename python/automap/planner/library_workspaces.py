"""A plan's budget and peak with the math libraries' workspaces
(``automap.cluster.workspace``): the bytes cuBLAS and cuBLASLt hold on each
CUDA device through the whole step, outside every tensor the generated
program makes. The search plans within the budget less them, and the plan it
returns reports them: in its peak, its breakdown (``library_workspaces``), its
timeline and each pipeline stage's peak. An error names the least budget with
them. (Before, every budgeted CUDA plan measured 65-66 MiB over its budget on
an H200.)"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from automap.errors import InfeasibleBudgetError
from automap.planner.plan import Plan

CATEGORY = "library_workspaces"

#: The least a budget leaves the plan where the workspaces take all of it:
#: the search then fails and names the least budget it needs.
_LEAST_LEFT_BYTES = 1.0

_LEAST = re.compile(r"the smallest feasible budget is about ([0-9.eE+-]+) bytes( \([^,)]*)?")


def within_library_workspaces(search: Callable[[float | None], Plan],
                              memory_budget_bytes: float | None,
                              workspace_bytes: int) -> Plan:
    """``search`` at ``memory_budget_bytes`` less ``workspace_bytes``; the plan
    it returns with them held, or its ``InfeasibleBudgetError`` with them
    added to the least budget it names."""
    if not workspace_bytes:
        return search(memory_budget_bytes)
    left = None if memory_budget_bytes is None else \
        max(memory_budget_bytes - workspace_bytes, _LEAST_LEFT_BYTES)
    try:
        found = search(left)
    except InfeasibleBudgetError as err:
        raise _with_workspaces(err, memory_budget_bytes, workspace_bytes) from None
    return holding_library_workspaces(found, workspace_bytes, memory_budget_bytes)


def holding_library_workspaces(found: Plan, workspace_bytes: int,
                               memory_budget_bytes: float | None) -> Plan:
    """``found`` (planned within ``memory_budget_bytes`` less the workspaces)
    reporting the workspaces in its peak, breakdown, timeline and stages, and
    the budget asked for."""
    found.predicted_peak_memory_bytes += workspace_bytes
    found.memory_budget_bytes = memory_budget_bytes
    found.memory_breakdown = {**found.memory_breakdown, CATEGORY: workspace_bytes}
    found.cost_constants = {**found.cost_constants, "library_workspace_bytes": workspace_bytes}
    if found.memory_timeline is not None:
        categories = list(found.memory_timeline["categories"])
        if CATEGORY not in categories:
            categories.append(CATEGORY)
        column = categories.index(CATEGORY)
        samples = []
        for sample in found.memory_timeline["samples"]:
            row = list(sample["bytes"]) + [0] * (len(categories) - len(sample["bytes"]))
            row[column] += workspace_bytes
            samples.append({**sample, "bytes": row})
        found.memory_timeline = {**found.memory_timeline, "categories": categories,
                                 "samples": samples}
    if found.pipeline is not None:
        stages = tuple(dataclasses.replace(
            stage, predicted_peak_memory_bytes=stage.predicted_peak_memory_bytes + workspace_bytes)
            for stage in found.pipeline.stages)
        found.pipeline = dataclasses.replace(found.pipeline, stages=stages)
    return found


def _with_workspaces(err: InfeasibleBudgetError, memory_budget_bytes: float | None,
                     workspace_bytes: int) -> InfeasibleBudgetError:
    least = err.smallest_feasible_budget_bytes
    text = str(err)
    if least is not None:
        total = least + workspace_bytes

        def named(match: re.Match) -> str:
            size = f"{total / 2**20:.1f} MiB"
            return (f"the smallest feasible budget is about {total:.4g} bytes "
                    + (f"({size}" if match.group(2) else f"({size})"))

        text = _LEAST.sub(named, text, count=1)
    asked = "" if memory_budget_bytes is None else f"a budget of {memory_budget_bytes:.4g} bytes "
    return InfeasibleBudgetError(
        f"{asked}less the {workspace_bytes / 2**20:.4g} MiB the math libraries hold on each "
        f"device (cuBLAS and cuBLASLt workspaces) leaves the plan too little: {text}",
        None if least is None else int(least + workspace_bytes))
