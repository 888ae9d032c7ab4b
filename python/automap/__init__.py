"""automap: automatic intra-op parallelism and activation checkpointing for
PyTorch training. See the README for the one-line API."""

from automap.api import apply, autoparallelize
from automap.cluster import Cluster, Device
from automap.detect import detect_cluster
from automap.errors import (
    AutomapError,
    InfeasibleBudgetError,
    InfeasiblePlanError,
    InvalidChainError,
    InvalidMeshError,
    InvalidSpecError,
    SolverTimeLimitError,
    StalePlanError,
    TraceError,
    UnsupportedOpError,
)
from automap.generate import ParallelModule
from automap.layout import (
    LayoutPath,
    LayoutStep,
    clear_layout_cache,
    layout_cache_stats,
    layout_path,
    resharding_cost_matrix,
)
from automap.mesh import DeviceMesh
from automap.plan import Plan
from automap.planner import plan
from automap.profiling import Profile, profile
from automap.spec import ShardingSpec, enumerate_specs
from automap.tracing import TracedGraph, trace

__version__ = "0.1.0"

__all__ = [
    "AutomapError",
    "Cluster",
    "Device",
    "DeviceMesh",
    "InfeasibleBudgetError",
    "InfeasiblePlanError",
    "InvalidChainError",
    "InvalidMeshError",
    "InvalidSpecError",
    "LayoutPath",
    "LayoutStep",
    "ParallelModule",
    "Plan",
    "Profile",
    "ShardingSpec",
    "SolverTimeLimitError",
    "StalePlanError",
    "TraceError",
    "TracedGraph",
    "UnsupportedOpError",
    "apply",
    "autoparallelize",
    "clear_layout_cache",
    "detect_cluster",
    "enumerate_specs",
    "layout_cache_stats",
    "layout_path",
    "plan",
    "profile",
    "resharding_cost_matrix",
    "trace",
]
