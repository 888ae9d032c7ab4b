"""The exception hierarchy of automap. Every error automap raises on purpose is
an ``AutomapError``; the native core's errors are mapped onto these classes."""

from __future__ import annotations


class AutomapError(Exception):
    """Base class of every error automap raises on purpose."""


class InvalidArgumentError(AutomapError, ValueError):
    """An argument outside what is allowed: a negative, non-finite or absurd
    number, a wrong type, an index out of range. The message names the
    argument, the value and what is allowed."""


class LimitExceededError(InvalidArgumentError):
    """An input of a valid form whose size passes one of automap's caps (devices
    in a mesh, specs of a tensor, strategies of a node, bytes of a tensor); the
    message names the cap."""


class InvalidPipelineError(InvalidArgumentError):
    """Pipeline arguments that cannot work: microbatches that do not divide the
    batch, more stages than layers or devices, an unknown schedule."""


class InvalidSpecError(AutomapError, ValueError):
    """A sharding spec that cannot be parsed or does not fit a tensor and mesh."""


class InvalidMeshError(AutomapError, ValueError):
    """A device mesh that is inconsistent, or does not match the process group."""


class TraceError(AutomapError):
    """A model that cannot be traced (exported) for planning."""


class UnsupportedFunctionError(TraceError):
    """A custom ``torch.autograd.Function`` that automap cannot keep as one opaque
    op (it would otherwise be traced through and trained with the wrong
    gradient); ``function`` names it."""

    def __init__(self, message: str, function: str) -> None:
        super().__init__(message)
        self.function = function


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


class InvalidPlanError(AutomapError, ValueError):
    """A plan file that is not a plan automap wrote: unreadable JSON, a field
    of the wrong type, content that does not match its fingerprint (edited by
    hand), or specs and collectives that do not fit the graph."""


class InputMismatchError(AutomapError, ValueError):
    """Inputs given to a generated module that differ in structure, shape or
    dtype from those the plan was made for."""


class TrainingModeError(AutomapError, RuntimeError):
    """``.train(mode)`` / ``.eval()`` on a generated module whose graph was traced
    in the other mode (dropout and batch norm are part of the graph)."""


class DistributedError(AutomapError, RuntimeError):
    """A failure of the process group during planning or setup: another rank
    failed (its error class and message are in this one's) or did not answer
    within the setup timeout."""


#: The name the solver issue uses for the same condition.
InfeasiblePlanError = InfeasibleBudgetError


class InvalidCostModelError(AutomapError, ValueError):
    """A device speed (FLOP/s, memory bandwidth, per-kernel overhead) that is
    not a finite number > 0."""


class PipelineError(AutomapError, RuntimeError):
    """A pipelined module used in a way it cannot run: its loss differentiated
    with a gradient other than 1 (the schedule already ran the backward), or a
    value that cannot cross a stage boundary."""
