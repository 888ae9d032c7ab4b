"""Type stubs of automap's native core (rust/python.rs)."""

from collections.abc import Sequence
from typing import Any, final

__all__ = [
    "CheckpointBlock",
    "CollectivePlan",
    "CollectiveStep",
    "LayoutPath",
    "LayoutStep",
    "Mesh",
    "ShardingSpec",
    "clear_layout_cache",
    "detect_blocks",
    "einsum_strategies",
    "enumerate_specs",
    "layout_cache_stats",
    "layout_path",
    "linearize",
    "reshape_strategies",
    "resharding_costs",
    "conversion_network",
    "RotorSchedule",
    "solve_rotor",
]

@final
class Mesh:
    def __new__(
        cls,
        shape: Sequence[int],
        ranks: Sequence[int] | None,
        alpha_s: Sequence[float],
        bandwidth_bytes_per_s: Sequence[float],
        reduce_scatter_as_all_reduce: bool = False,
    ) -> Mesh: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def ranks(self) -> list[int]: ...
    @property
    def alpha_s(self) -> list[float]: ...
    @property
    def bandwidth_bytes_per_s(self) -> list[float]: ...
    @property
    def reduce_scatter_as_all_reduce(self) -> bool: ...
    def coordinate(self, rank: int) -> list[int]: ...
    def rank_at(self, coordinate: Sequence[int]) -> int: ...
    def axis_groups(self, axes: Sequence[int]) -> list[list[int]]: ...
    def collective_cost_s(self, kind: str, nbytes: float, axes: Sequence[int]) -> float: ...
    def collective_plan(self, kind: str, nbytes: float, axes: Sequence[int]) -> CollectivePlan: ...

@final
class CollectiveStep:
    @property
    def kind(self) -> str: ...
    @property
    def axes(self) -> list[int]: ...
    @property
    def nbytes(self) -> float: ...
    @property
    def cost_s(self) -> float: ...

@final
class CollectivePlan:
    @property
    def kind(self) -> str: ...
    @property
    def nbytes(self) -> float: ...
    @property
    def flat(self) -> bool: ...
    @property
    def cost_s(self) -> float: ...
    @property
    def steps(self) -> list[CollectiveStep]: ...

@final
class ShardingSpec:
    @staticmethod
    def parse(text: str) -> ShardingSpec: ...
    @staticmethod
    def from_dims(dims: Sequence[Sequence[int]]) -> ShardingSpec: ...
    @staticmethod
    def replicated(rank: int) -> ShardingSpec: ...
    @property
    def rank(self) -> int: ...
    @property
    def dims(self) -> list[list[int]]: ...
    @property
    def is_replicated(self) -> bool: ...
    def validate(self, shape: Sequence[int], mesh: Any) -> None: ...
    def local_shape(self, shape: Sequence[int], mesh: Any) -> list[int]: ...
    def local_slices(self, shape: Sequence[int], mesh: Any, rank: int) -> list[tuple[int, int]]: ...
    def shard_count(self, mesh: Any) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[Any, tuple[str]]: ...

@final
class LayoutStep:
    @property
    def kind(self) -> str: ...
    @property
    def axis(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def to_dim(self) -> int | None: ...
    @property
    def before(self) -> ShardingSpec: ...
    @property
    def after(self) -> ShardingSpec: ...
    @property
    def forward_cost_s(self) -> float: ...
    @property
    def backward_cost_s(self) -> float: ...
    @property
    def cost_s(self) -> float: ...

@final
class LayoutPath:
    @property
    def src(self) -> ShardingSpec: ...
    @property
    def dst(self) -> ShardingSpec: ...
    @property
    def steps(self) -> list[LayoutStep]: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def dtype_bytes(self) -> int: ...
    @property
    def forward_cost_s(self) -> float: ...
    @property
    def backward_cost_s(self) -> float: ...
    @property
    def cost_s(self) -> float: ...
    def __len__(self) -> int: ...

@final
class CheckpointBlock:
    @property
    def start_stage(self) -> int: ...
    @property
    def end_stage(self) -> int: ...
    @property
    def children(self) -> list[CheckpointBlock]: ...

@final
class RotorSchedule:
    @property
    def ops(self) -> list[tuple[str, int]]: ...
    @property
    def blocks(self) -> list[CheckpointBlock]: ...
    @property
    def predicted_time_s(self) -> float: ...
    @property
    def peak_memory_bytes(self) -> int: ...
    @property
    def no_recompute_time_s(self) -> float: ...
    @property
    def budget_bytes(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def op_memory_bytes(self) -> list[int]: ...
    @property
    def recompute_time_s(self) -> float: ...

def solve_rotor(
    fwd_compute_s: Sequence[float],
    bwd_compute_s: Sequence[float],
    out_bytes: Sequence[int],
    saved_bytes: Sequence[int],
    budget_bytes: int,
    *,
    fwd_comm_s: Sequence[float] | None = None,
    bwd_comm_s: Sequence[float] | None = None,
    fwd_tmp_bytes: Sequence[int] | None = None,
    fwd_comm_tmp_bytes: Sequence[int] | None = None,
    save_fwd_tmp_bytes: Sequence[int] | None = None,
    bwd_tmp_bytes: Sequence[int] | None = None,
    bwd_comm_tmp_bytes: Sequence[int] | None = None,
    out_grad_bytes: Sequence[int] | None = None,
    param_grad_bytes: Sequence[int] | None = None,
    frees_input: Sequence[bool] | None = None,
    input_bytes: int = 0,
    input_grad_bytes: int = 0,
    slots: int = ...,
) -> RotorSchedule: ...
def layout_path(
    mesh: Any,
    src: ShardingSpec | str,
    dst: ShardingSpec | str,
    shape: Sequence[int],
    dtype_bytes: int = 4,
    method: str = "optimal",
) -> LayoutPath: ...
def resharding_costs(
    mesh: Any,
    srcs: Sequence[ShardingSpec | str],
    dsts: Sequence[ShardingSpec | str],
    shape: Sequence[int],
    dtype_bytes: int = 4,
) -> tuple[bytes, bytes]: ...
def conversion_network(
    mesh: Any,
    srcs: Sequence[ShardingSpec | str],
    dsts: Sequence[ShardingSpec | str],
    shape: Sequence[int],
    dtype_bytes: int = 4,
) -> tuple[int, bytes, bytes, bytes, bytes, bytes]: ...
def einsum_strategies(
    mesh: Any,
    flops_per_s: float,
    memory_bandwidth_bytes_per_s: float,
    op_overhead_s: float,
    letter_sizes: Sequence[int],
    unshardable: Sequence[bool],
    inputs: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    input_bytes: Sequence[float],
    output_bytes: Sequence[float],
    input_needs_grad: Sequence[bool],
    input_additive: Sequence[bool],
    flops: float,
    is_view: bool,
) -> tuple[
    list[list[str]],
    list[list[str]],
    bytes,
    list[tuple[list[int], int | None, list[list[int]]]],
]: ...
def reshape_strategies(
    input_shape: Sequence[int], output_shape: Sequence[int], mesh: Any
) -> list[tuple[str, str]]: ...
def detect_blocks(
    keys: Sequence[str],
    shape_keys: Sequence[str],
    module_paths: Sequence[str],
    inputs: Sequence[Sequence[int]],
) -> list[tuple[str, list[list[int]]]]: ...
def linearize(
    parents: Sequence[Sequence[int]],
    placeholder: Sequence[bool],
    non_differentiable: Sequence[bool],
    inplace: Sequence[bool],
) -> list[list[int]]: ...
def enumerate_specs(shape: Sequence[int], mesh: Any) -> list[ShardingSpec]: ...
def layout_cache_stats() -> tuple[int, int]: ...
def clear_layout_cache() -> None: ...
