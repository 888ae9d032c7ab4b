"""Sharding specs (the native ``ShardingSpec``) and spec enumeration."""

from __future__ import annotations

from collections.abc import Sequence

from automap import _core
from automap._core import ShardingSpec

__all__ = ["ShardingSpec", "enumerate_specs"]


def enumerate_specs(shape: Sequence[int], mesh) -> list[ShardingSpec]:
    """Every valid sharding spec of a tensor of ``shape`` on ``mesh``."""
    return _core.enumerate_specs(list(shape), mesh)
