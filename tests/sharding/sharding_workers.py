"""Functions run inside spawned gloo processes by the multi-process tests
(module level, so that spawned children can import them)."""

from __future__ import annotations

import time

import torch

from automap import DeviceMesh, enumerate_specs, layout_cache_stats, layout_path
from automap.sharding.redistribute import redistribute


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


def _check_collective(failures, label, fn, x, want_y, upstream, want_grad) -> None:
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(upstream)
    if not torch.allclose(y.detach(), want_y, atol=1e-5):
        failures.append(f"{label}: forward")
    if not torch.allclose(x.grad, want_grad, atol=1e-5):
        failures.append(f"{label}: backward")


def check_collectives(rank: int, world: int, mesh_dict: dict) -> list[str]:
    """Each autograd collective against its definition on full tensors, on
    every single axis and every ordered pair of axes of the mesh."""
    import itertools
    from functools import partial

    from automap.sharding.collectives import (
        all_gather_dim,
        all_reduce_sum,
        all_to_all_dims,
        identity_all_reduce_grad,
        reduce_scatter_dim,
        split_dim,
    )

    mesh = DeviceMesh.from_dict(mesh_dict)
    groups = mesh.process_groups()
    failures: list[str] = []
    axis_sets = [(a,) for a in range(mesh.ndim)] + list(itertools.permutations(range(mesh.ndim), 2))
    for axes in axis_sets:
        g = groups.axis_group(axes)
        members = next(m for m in mesh.axis_groups(list(axes)) if rank in m)
        n, me, blk = len(members), g.index, 4
        gen = torch.Generator().manual_seed(7)
        # Per-member contributions and upstream gradients, known to every rank.
        parts = torch.randn((n, blk * n, 3), generator=gen)
        grads = torch.randn((n, blk * n, 3), generator=gen)
        total, mine = parts.sum(0), slice(me * blk, (me + 1) * blk)
        cols, cols_grad = torch.cat(list(parts), dim=1), torch.cat(list(grads), dim=1)
        wide = torch.randn((blk * n, 3 * n), generator=gen)
        wide_grad = torch.randn((blk * n, 3 * n), generator=gen)
        my_cols = slice(me * 3, (me + 1) * 3)
        cases = [
            # all-reduce of partial sums; backward identity.
            ("all_reduce_sum", partial(all_reduce_sum, group=g), parts[me], total, grads[0],
             grads[0]),
            # identity whose backward sums the (partial) gradients.
            ("identity_all_reduce_grad", partial(identity_all_reduce_grad, group=g), parts[0],
             parts[0], grads[me], grads.sum(0)),
            # reduce-scatter along dim 0: own block of the sum; backward all-gather.
            ("reduce_scatter_dim", partial(reduce_scatter_dim, dim=0, group=g), parts[me],
             total[mine], grads[0][mine], grads[0]),
            # all-gather of distinct per-member blocks along dim 1; backward keeps own block.
            ("all_gather_dim", partial(all_gather_dim, dim=1, group=g), parts[me], cols,
             cols_grad, grads[me]),
            ("split_dim", partial(split_dim, dim=0, group=g), parts[0], parts[0][mine],
             grads[0][mine], grads[0]),
            # all-to-all: dim 0 gathered, dim 1 split.
            ("all_to_all_dims", partial(all_to_all_dims, src_dim=0, dst_dim=1, group=g),
             wide[mine], wide[:, my_cols], wide_grad[:, my_cols], wide_grad[mine]),
        ]
        for name, fn, x, want_y, upstream, want_grad in cases:
            _check_collective(failures, f"{name} axes {axes} rank {rank}", fn, x, want_y,
                              upstream, want_grad)
    return failures
