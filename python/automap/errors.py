"""The exception hierarchy of automap. Every error automap raises on purpose is
an ``AutomapError``; the native core's errors are mapped onto these classes."""

from __future__ import annotations


class AutomapError(Exception):
    """Base class of every error automap raises on purpose."""


class InvalidSpecError(AutomapError, ValueError):
    """A sharding spec that cannot be parsed or does not fit a tensor and mesh."""


class InvalidMeshError(AutomapError, ValueError):
    """A device mesh that is inconsistent, or does not match the process group."""


class TraceError(AutomapError):
    """A model that cannot be traced (exported) for planning."""


class UnsupportedOpError(AutomapError):
    """Ops without a sharding generator, raised when planning strictly.

    ``ops`` lists every unsupported op at once."""

    def __init__(self, message: str, ops: list[str] | None = None) -> None:
        super().__init__(message)
        self.ops = list(ops or [])


class InfeasibleBudgetError(AutomapError):
    """No plan fits the memory budget; ``smallest_feasible_budget_bytes`` says
    what would (None when unknown)."""

    def __init__(self, message: str, smallest_feasible_budget_bytes: int | None = None) -> None:
        super().__init__(message)
        self.smallest_feasible_budget_bytes = smallest_feasible_budget_bytes


class SolverTimeLimitError(AutomapError):
    """The solver hit its time limit without any feasible plan."""


class InvalidChainError(AutomapError, ValueError):
    """A checkpointing chain with inconsistent stage quantities."""


class StalePlanError(AutomapError):
    """A plan that was made for another graph, model or mesh."""


#: The name the solver issue uses for the same condition.
InfeasiblePlanError = InfeasibleBudgetError


class InvalidCostModelError(AutomapError, ValueError):
    """A device speed (FLOP/s, memory bandwidth, per-kernel overhead) that is
    not a finite number > 0."""
