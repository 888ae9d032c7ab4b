"""automap: automatic intra-op parallelism and activation checkpointing for
PyTorch training. See the README for the one-line API.

The public names load on first use (PEP 562), so ``import automap`` and the
command line's ``--help`` do not import torch."""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from automap.errors import (
    AutomapError,
    DistributedError,
    InfeasibleBudgetError,
    InfeasiblePlanError,
    InputMismatchError,
    InvalidArgumentError,
    InvalidChainError,
    InvalidCostModelError,
    InvalidMeshError,
    InvalidPlanError,
    InvalidSpecError,
    LimitExceededError,
    SolverTimeLimitError,
    StalePlanError,
    TraceError,
    TrainingModeError,
    UnsupportedFunctionError,
    UnsupportedOpError,
)
from automap.version import __version__ as __version__

if TYPE_CHECKING:
    from automap.api import apply, autoparallelize
    from automap.cluster.cluster import Cluster, Device
    from automap.cluster.detect import detect_cluster
    from automap.cluster.device import DeviceProfile
    from automap.generate.dtensor_state import get_state_dict, set_state_dict
    from automap.generate.grad_scaler import GradScaler
    from automap.generate.module import ParallelModule
    from automap.planner.plan import Plan
    from automap.planner.search import plan
    from automap.sharding.layout import (
        LayoutPath,
        LayoutStep,
        clear_layout_cache,
        layout_cache_stats,
        layout_path,
        resharding_cost_matrix,
    )
    from automap.sharding.mesh import DeviceMesh
    from automap.sharding.spec import ShardingSpec, enumerate_specs
    from automap.trace.mixed_precision import MixedPrecision
    from automap.trace.profiling import Profile, profile
    from automap.trace.tracing import TracedGraph, trace

#: Where each lazily loaded public name lives.
_LAZY = {
    "apply": "automap.api",
    "autoparallelize": "automap.api",
    "Cluster": "automap.cluster.cluster",
    "Device": "automap.cluster.cluster",
    "detect_cluster": "automap.cluster.detect",
    "DeviceProfile": "automap.cluster.device",
    "GradScaler": "automap.generate.grad_scaler",
    "ParallelModule": "automap.generate.module",
    "get_state_dict": "automap.generate.dtensor_state",
    "set_state_dict": "automap.generate.dtensor_state",
    "Plan": "automap.planner.plan",
    "plan": "automap.planner.search",
    "LayoutPath": "automap.sharding.layout",
    "LayoutStep": "automap.sharding.layout",
    "clear_layout_cache": "automap.sharding.layout",
    "layout_cache_stats": "automap.sharding.layout",
    "layout_path": "automap.sharding.layout",
    "resharding_cost_matrix": "automap.sharding.layout",
    "DeviceMesh": "automap.sharding.mesh",
    "ShardingSpec": "automap.sharding.spec",
    "enumerate_specs": "automap.sharding.spec",
    "MixedPrecision": "automap.trace.mixed_precision",
    "Profile": "automap.trace.profiling",
    "profile": "automap.trace.profiling",
    "TracedGraph": "automap.trace.tracing",
    "trace": "automap.trace.tracing",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'automap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Importing the subpackage ``automap.trace`` sets the attribute ``trace`` of
    this package to it; ``automap.trace`` stays the function (loaded lazily)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            self.__dict__.pop(name, None)
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "AutomapError",
    "Cluster",
    "Device",
    "DeviceProfile",
    "DeviceMesh",
    "DistributedError",
    "GradScaler",
    "InfeasibleBudgetError",
    "InfeasiblePlanError",
    "InputMismatchError",
    "InvalidArgumentError",
    "InvalidChainError",
    "InvalidCostModelError",
    "InvalidMeshError",
    "InvalidPlanError",
    "InvalidSpecError",
    "LayoutPath",
    "LayoutStep",
    "LimitExceededError",
    "MixedPrecision",
    "ParallelModule",
    "Plan",
    "Profile",
    "ShardingSpec",
    "SolverTimeLimitError",
    "StalePlanError",
    "TraceError",
    "TrainingModeError",
    "TracedGraph",
    "UnsupportedFunctionError",
    "UnsupportedOpError",
    "apply",
    "autoparallelize",
    "clear_layout_cache",
    "detect_cluster",
    "enumerate_specs",
    "get_state_dict",
    "layout_cache_stats",
    "layout_path",
    "plan",
    "profile",
    "resharding_cost_matrix",
    "set_state_dict",
    "trace",
]
