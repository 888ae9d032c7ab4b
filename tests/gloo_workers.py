"""Functions run inside spawned gloo processes by the multi-process tests
(module level, so that spawned children can import them)."""

from __future__ import annotations

import time

import torch
from automap import DeviceMesh, enumerate_specs, layout_cache_stats, layout_path
from automap.redistribute import redistribute


def check_all_conversions(rank: int, world: int, cases: list) -> dict:
    """For each (mesh dict, shapes) case, run every ordered pair of valid specs
    of every shape through its layout path on real data, forward and backward.
    Returns pair counts and up to 20 failure descriptions."""
    failures: list[str] = []
    pairs = 0
    start = time.perf_counter()
    for mesh_dict, shapes in cases:
        mesh = DeviceMesh.from_dict(mesh_dict)
        pairs += _check_mesh(rank, mesh, mesh.process_groups(), shapes, failures)
    return {"pairs": pairs, "failures": failures, "seconds": time.perf_counter() - start}


def _check_mesh(rank, mesh, groups, shapes, failures) -> int:
    pairs = 0
    for shape in shapes:
        specs = enumerate_specs(shape, mesh)
        gen = torch.Generator().manual_seed(len(shape))
        full = torch.randn(shape, generator=gen)
        full_grad = torch.randn(shape, generator=gen)
        mine = {s: tuple(slice(a, b) for a, b in s.local_slices(shape, mesh, rank)) for s in specs}
        # Search every path first, so that executing them below only hits the cache.
        paths = {(s, d): layout_path(mesh, s, d, shape, 4) for s in specs for d in specs}
        searches_before = layout_cache_stats()[1]
        for (src, dst), path in paths.items():
            x = full[mine[src]].clone().requires_grad_(True)
            y = redistribute(x, path, groups)
            y.backward(full_grad[mine[dst]])
            pairs += 1
            if not torch.equal(y.detach(), full[mine[dst]]):
                failures.append(f"{mesh.shape} {shape} {src}->{dst} rank {rank}: wrong shard")
            elif not torch.equal(x.grad, full_grad[mine[src]]):
                failures.append(f"{mesh.shape} {shape} {src}->{dst} rank {rank}: wrong gradient")
            if len(failures) >= 20:
                break
        assert layout_cache_stats()[1] == searches_before, "executing a path searched"
    return pairs
