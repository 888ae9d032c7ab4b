"""A plain pure-Python implementation of automap's layout search (the same A*
over the same one-step moves and the same cost model), written for the
benchmark that measures the native core against it, and used by the tests as
an independent oracle. Specs are tuples of per-dim axis tuples."""

from __future__ import annotations

import heapq
import math
from itertools import count


def ring_cost_s(kind: str, nbytes: float, n: int, bw: float, alpha: float) -> float:
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    volume = {"all_gather": frac, "all_to_all": frac, "reduce_scatter": frac,
              "all_reduce": 2 * frac, "broadcast": 1.0}[kind] * nbytes
    return volume / bw + alpha


class PyLayoutProblem:
    def __init__(self, mesh_shape, alpha_s, bandwidth, shape, dtype_bytes=4):
        self.mesh_shape = list(mesh_shape)
        self.alpha = list(alpha_s)
        self.bw = list(bandwidth)
        self.shape = list(shape)
        self.total_bytes = math.prod(shape) * dtype_bytes

    def local_bytes(self, spec) -> float:
        return self.total_bytes / math.prod(self.mesh_shape[a] for axes in spec for a in axes)

    def cost(self, kind, nbytes, axis) -> float:
        return ring_cost_s(kind, nbytes, self.mesh_shape[axis], self.bw[axis], self.alpha[axis])

    def moves(self, spec):
        """(kind, axis, dim, to_dim, after, forward_s, backward_s) for every legal move."""
        local = [s // math.prod(self.mesh_shape[a] for a in axes)
                 for s, axes in zip(self.shape, spec)]
        b = self.local_bytes(spec)
        out = []
        for d, axes in enumerate(spec):
            if not axes:
                continue
            axis = axes[-1]
            n = self.mesh_shape[axis]
            gathered = spec[:d] + (axes[:-1],) + spec[d + 1:]
            out.append(("all_gather", axis, d, None, gathered,
                        self.cost("all_gather", b * n, axis), 0.0))
            a2a = self.cost("all_to_all", b, axis)
            for t in range(len(spec)):
                if t != d and local[t] % n == 0:
                    after = list(gathered)
                    after[t] = after[t] + (axis,)
                    out.append(("all_to_all", axis, d, t, tuple(after), a2a, a2a))
        used = {a for axes in spec for a in axes}
        for axis, n in enumerate(self.mesh_shape):
            if axis in used:
                continue
            grad_gather = self.cost("all_gather", b, axis)
            for d in range(len(spec)):
                if local[d] % n == 0:
                    after = spec[:d] + (spec[d] + (axis,),) + spec[d + 1:]
                    out.append(("shard", axis, d, None, after, 0.0, grad_gather))
        return out

    def lower_bound(self, spec, target) -> float:
        b_min = self.total_bytes / math.prod(self.mesh_shape)
        where = {a: (d, i) for d, axes in enumerate(spec) for i, a in enumerate(axes)}
        goal = {a: (d, i) for d, axes in enumerate(target) for i, a in enumerate(axes)}
        bound = 0.0
        for axis in range(len(self.mesh_shape)):
            here, there = where.get(axis), goal.get(axis)
            if here is None and there is None:
                continue
            if here is not None and there is not None:
                d, i = here
                if there[0] == d and target[d][: i + 1] == spec[d][: i + 1]:
                    continue
                steps = 2
            else:
                steps = 1
            bound += steps * self.cost("all_gather", b_min, axis)
        return bound

    def optimal_path(self, src, dst):
        """(cost_s, steps) of the cheapest path; ties go to fewer steps."""
        tie = count()
        best = {src: (0.0, 0)}
        parent = {src: None}
        closed = set()
        heap = [(self.lower_bound(src, dst), 0, next(tie), src)]
        while heap:
            _, _, _, spec = heapq.heappop(heap)
            if spec in closed:
                continue
            closed.add(spec)
            if spec == dst:
                steps = []
                while parent[spec] is not None:
                    move = parent[spec]
                    steps.append(move)
                    spec = move[-1]
                return best[dst][0], steps[::-1]
            cost, nsteps = best[spec]
            for kind, axis, d, t, after, fwd, bwd in self.moves(spec):
                new = (cost + fwd + bwd, nsteps + 1)
                if after not in closed and (after not in best or new < best[after]):
                    best[after] = new
                    parent[after] = (kind, axis, d, t, fwd, bwd, spec)
                    heapq.heappush(heap, (new[0] + self.lower_bound(after, dst), new[1],
                                          next(tie), after))
        raise AssertionError("unreachable")


def to_tuple_spec(spec) -> tuple:
    """automap.ShardingSpec -> tuple of per-dim axis tuples."""
    return tuple(tuple(axes) for axes in spec.dims)
