"""automap: automatic intra-op parallelism and activation checkpointing for
PyTorch training. See the README for the one-line API."""

from automap.api import apply, autoparallelize
from automap.cluster.cluster import Cluster, Device
from automap.cluster.detect import detect_cluster
from automap.cluster.device import DeviceProfile
from automap.errors import (
    AutomapError,
    InfeasibleBudgetError,
    InfeasiblePlanError,
    InvalidChainError,
    InvalidCostModelError,
    InvalidMeshError,
    InvalidSpecError,
    SolverTimeLimitError,
    StalePlanError,
    TraceError,
    UnsupportedOpError,
)
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
from automap.trace.profiling import Profile, profile
from automap.trace.tracing import TracedGraph, trace
from automap.version import __version__ as __version__

__all__ = [
    "AutomapError",
    "Cluster",
    "Device",
    "DeviceProfile",
    "DeviceMesh",
    "InfeasibleBudgetError",
    "InfeasiblePlanError",
    "InvalidChainError",
    "InvalidCostModelError",
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
