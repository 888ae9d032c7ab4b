"""Functions run inside spawned gloo processes by the multi-process tests
(module level, so that spawned children can import them)."""

from __future__ import annotations

import time
from functools import partial

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


def _check_collective(failures, label, fn, x, want_y, upstream, want_grad,
                      column_major: bool = False) -> None:
    """``column_major``: ``x`` and ``upstream`` laid out transposed in memory; the
    result and the gradient must keep that layout (a conversion keeps its
    input's memory order: ``collectives._keeping_layout``)."""
    x = (_column_major(x) if column_major else x.clone()).requires_grad_(True)
    y = fn(x)
    y.backward(_column_major(upstream) if column_major else upstream)
    if not torch.allclose(y.detach(), want_y, atol=1e-5):
        failures.append(f"{label}: forward")
    if not torch.allclose(x.grad, want_grad, atol=1e-5):
        failures.append(f"{label}: backward")
    if column_major and not (y.t().is_contiguous() and x.grad.t().is_contiguous()):
        failures.append(f"{label}: layout {y.stride()}, gradient {x.grad.stride()}")


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def check_collectives(rank: int, world: int, mesh_dict: dict) -> list[str]:
    """Each autograd collective against its definition on full tensors, on
    every single axis and every ordered pair of axes of the mesh."""
    import itertools

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
            if name in ("reduce_scatter_dim", "all_gather_dim", "all_to_all_dims"):
                _check_collective(failures, f"{name} axes {axes} rank {rank}, transposed",
                                  fn, x, want_y, upstream, want_grad, column_major=True)
    return failures


_RECORDED = {  # torch.distributed call -> (collective, index of the buffer the price is about)
    "all_reduce": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_to_all_single": ("all_to_all", 1),
}


def _record_calls(log: list) -> None:
    """Make every collective call of torch.distributed append (kind, group ranks,
    bytes) to ``log``: what the program really executes."""
    import torch.distributed as dist

    for name, (kind, buffer) in _RECORDED.items():
        original = getattr(dist, name)

        def wrapper(*args, _original=original, _kind=kind, _buffer=buffer, **kwargs):
            t = args[_buffer]
            ranks = tuple(sorted(dist.get_process_group_ranks(kwargs["group"])))
            log.append((_kind, ranks, t.numel() * t.element_size()))
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)


def check_collective_algorithms(rank: int, world: int, mesh_dicts: list) -> dict:
    """For every collective over every ordered set of two or more axes of each
    mesh, on a small and a large buffer: the process-group calls the program
    makes (recorded) are the steps ``mesh.collective_plan`` priced, and the
    values equal those of one flat call on the whole group (gathers and
    exchanges exactly, sums to float tolerance), forward and backward; the
    bucketed gradient all-reduce too. Returns the failures and, per collective,
    the algorithms seen ("flat", or the kinds of the per-axis steps)."""
    import itertools

    log: list = []
    _record_calls(log)
    failures: list[str] = []
    seen: dict[str, set] = {}
    for mesh_dict in mesh_dicts:
        mesh = DeviceMesh.from_dict(mesh_dict)
        groups = mesh.process_groups()
        axis_sets = [p for k in range(2, mesh.ndim + 1)
                     for p in itertools.permutations(range(mesh.ndim), k)]
        for axes, rows in itertools.product(axis_sets, (2, 400, 2**15)):
            _check_algorithms_on(mesh, groups.axis_group(axes), rows, rank, log, seen, failures)
    return {"failures": failures[:20], "seen": {k: sorted(v) for k, v in seen.items()}}


def _check_algorithms_on(mesh, g, rows, rank, log, seen, failures) -> None:
    from torch import nn

    from automap.generate.grad_sync import GradientSync
    from automap.sharding import collectives as c

    def expect(kind, nbytes):
        plan = mesh.collective_plan(kind, nbytes, g.axes)
        seen.setdefault(kind, set()).add(
            "flat" if plan.flat else " ".join(step.kind for step in plan.steps))
        # gloo sums a reduce-scatter's stacked input in place with one all-reduce
        # (collectives._flat_reduce_scatter): the same group and bytes.
        return [("all_reduce" if s.kind == "reduce_scatter" else s.kind,
                 tuple(sorted(next(m for m in mesh.axis_groups(s.axes) if rank in m))),
                 s.nbytes) for s in plan.steps]

    def same(a, b, exact):
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    # The flat version: one call on the whole group.
    def flat_ar(t):
        return c._finish(c._flat_all_reduce(t.clone(), g))

    def flat_ag(t, d):
        return c._finish(c._flat_gather(t, d, g))

    def flat_a2a(t, s, d):
        return c._finish(c._flat_all_to_all(t, s, d, g))

    n, label = g.size, f"mesh {mesh.shape} axes {g.axes} rows {rows} rank {rank}"
    gen = torch.Generator().manual_seed(11 + rank)  # each rank's own partial values
    x = torch.randn((rows * n, 4 * n), generator=gen)
    up = torch.randn((rows * n, 4 * n), generator=gen)
    xb = x.numel() * 4
    narrow, short = x[:, :4], x[:rows]  # (rows n, 4) and (rows, 4 n)
    cases = [  # name, function, input, upstream, flat output, flat gradient, priced calls
        ("all_reduce_sum", partial(c.all_reduce_sum, group=g), x, up, flat_ar(x), up,
         expect("all_reduce", xb)),
        ("identity_all_reduce_grad", partial(c.identity_all_reduce_grad, group=g), x, up, x,
         flat_ar(up), expect("all_reduce", xb)),
        ("reduce_scatter_dim", partial(c.reduce_scatter_dim, dim=0, group=g), x, up[:rows],
         c._finish(c._flat_reduce_scatter(x, 0, g)), flat_ag(up[:rows], 0),
         expect("reduce_scatter", xb) + expect("all_gather", xb)),
        ("all_gather_dim", partial(c.all_gather_dim, dim=1, group=g), narrow, up,
         flat_ag(narrow, 1), up.chunk(n, 1)[g.index], expect("all_gather", xb)),
        ("all_to_all_dims", partial(c.all_to_all_dims, src_dim=0, dst_dim=1, group=g), short,
         up[:, :4], flat_a2a(short, 0, 1), flat_a2a(up[:, :4], 1, 0),
         expect("all_to_all", xb // n) * 2),
    ]
    for name, fn, inp, upstream, want_y, want_grad, calls in cases:
        exact = "reduce" not in name
        t = inp.clone().requires_grad_(True)
        del log[:]
        y = fn(t)
        y.backward(upstream)
        if log != calls:
            failures.append(f"{name} {label}: executed {log}, priced {calls}")
        if not same(y.detach(), want_y, exact):
            failures.append(f"{name} {label}: forward differs from the flat call")
        if not same(t.grad, want_grad, exact):
            failures.append(f"{name} {label}: backward differs from the flat call")
    # Bucketed gradient sync: two buckets of one parameter each; the second launch
    # moves the first on, so the calls interleave: compare them as a multiset.
    params = [nn.Parameter(torch.zeros_like(x)), nn.Parameter(torch.zeros(x.shape[0]))]
    want = [flat_ar(x), flat_ar(up[:, 0].contiguous())]
    calls = expect("all_reduce", xb) + expect("all_reduce", xb // 4 // n)
    sync = GradientSync([(p, g) for p in params], bucket_bytes=xb)
    del log[:]
    ((params[0] * x).sum() + (params[1] * up[:, 0]).sum()).backward()
    if sorted(log) != sorted(calls):
        failures.append(f"GradientSync {label}: executed {log}, priced {calls}")
    if not all(same(p.grad, w, False) for p, w in zip(params, want)):
        failures.append(f"GradientSync {label}: sums differ from the flat call")
    for h in sync.handles:
        h.remove()
