"""An ILP edge priced by a flow over its conversions' single steps, and, under
a budget, its conversion buffers counted by shard-count class (issue 15:
"shrink the formulation").

The transport block of an edge has one column per (producer spec, consumer
spec) pair: on a 3-D mesh a [4, 8, 32] activation has about 100 specs, so one
edge costs 10,000 columns. Its *time* is the optimal conversion's, a sum of
single-step costs, so a min-cost flow over the steps of the optimal paths
(``sharding.layout.conversion_network``) prices every fractional choice of
the two strategies as the transport does (the LP's value is the same).

Its *memory* (``solve.memory.edge_memory``: the forward and backward
transients and the kept copy) depends on the pair only through the two specs'
shard counts and whether they are equal, except for state (which axes a
gradient gathers) and inputs (a placeholder's view). Where that holds
(``ClassCoupling.coefficients`` checks it), a small transport between the
producer's and the consumer's shard-count classes (``w[c, d]``) carries the
buffers, and one variable per spec both sides may take (``z[s] <= x[s]``,
``z[s] <= y[s]``) takes back what an unconverted tensor does not hold. In an
integral plan ``w`` is the pair's classes and ``z`` may be 1 only where both
sides chose ``s``; every ``z`` coefficient is a refund (checked), so the
minimum sets it. The relaxation couples memory and time more loosely than
the transport did; the integral plans are the same."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Two memory entries of one class pair are the same where they agree to this.
_SAME = 1e-9


@dataclass(frozen=True)
class ClassCoupling:
    """Shard-count classes of an edge's distinct producer (``a``) and consumer
    (``b``) specs, and the spec pairs naming the same spec (``same_a[k]``,
    ``same_b[k]``)."""

    a_class: np.ndarray
    b_class: np.ndarray
    same_a: np.ndarray
    same_b: np.ndarray

    @property
    def num_a(self) -> int:
        return int(self.a_class.max()) + 1

    @property
    def num_b(self) -> int:
        return int(self.b_class.max()) + 1

    def coefficients(self, m: np.ndarray) -> np.ndarray | None:
        """Memory matrix ``m`` (distinct producer x consumer specs) as
        coefficients of ``[w (num_a x num_b, row-major), z (one per same
        pair)]``; None where ``m`` is not a function of the classes off the
        same-spec pairs, or where a same-spec pair would hold more than its
        class pair (the refund must not be negative)."""
        per_class = np.full((self.num_a, self.num_b), np.nan)
        diagonal = np.zeros(m.shape, dtype=bool)
        diagonal[self.same_a, self.same_b] = True
        ia, ib = np.nonzero(~diagonal)
        values = m[ia, ib]
        ca, cb = self.a_class[ia], self.b_class[ib]
        per_class[ca, cb] = values  # any one of them; checked next
        if not np.allclose(per_class[ca, cb], values, rtol=_SAME, atol=_SAME * np.abs(m).max()):
            return None
        per_class = np.nan_to_num(per_class, nan=0.0)  # only same-spec pairs there
        refund = m[self.same_a, self.same_b] - per_class[self.a_class[self.same_a],
                                                         self.b_class[self.same_b]]
        if (refund > 0).any():
            return None
        return np.concatenate((per_class.ravel(), refund))


def class_coupling(a_shards: np.ndarray, b_shards: np.ndarray, a_specs, b_specs
                   ) -> ClassCoupling:
    """The classes of specs with the given shard counts (and their names)."""
    counts = np.unique(np.concatenate((a_shards, b_shards)))
    b_pos = {s: j for j, s in enumerate(b_specs)}
    same = [(i, b_pos[s]) for i, s in enumerate(a_specs) if s in b_pos]
    _, a_class = np.unique(np.searchsorted(counts, a_shards), return_inverse=True)
    _, b_class = np.unique(np.searchsorted(counts, b_shards), return_inverse=True)
    return ClassCoupling(a_class.ravel(), b_class.ravel(),
                         np.array([i for i, _ in same], dtype=np.int64),
                         np.array([j for _, j in same], dtype=np.int64))


def add_flow_edge(b, net, weight: float, producer_cols, a_idx, consumer_cols, b_idx) -> int:
    """Min-cost flow columns of one edge on builder ``b``: one per step of
    ``net`` (its cost times ``weight``), one conservation row per spec (out -
    in = the producer's choice there - the consumer's). Returns the count."""
    arcs = b.columns(net.arc_cost_s * weight, integer=False, upper=1.0)
    spec_rows = b.rows(np.zeros(net.num_specs), np.zeros(net.num_specs))
    b.entries(spec_rows[net.arc_from], arcs, 1.0)
    b.entries(spec_rows[net.arc_to], arcs, -1.0)
    b.entries(spec_rows[net.src_pos[a_idx]], producer_cols, -1.0)
    b.entries(spec_rows[net.dst_pos[b_idx]], consumer_cols, 1.0)
    return len(arcs)


def add_class_coupling(b, coupling: ClassCoupling, producer_cols, a_idx, consumer_cols,
                       b_idx) -> np.ndarray:
    """The ``w`` and ``z`` columns of ``coupling`` on builder ``b`` (zero cost),
    tied to the two nodes' strategy columns; returns them, ``w`` first."""
    na, nb = coupling.num_a, coupling.num_b
    w = b.columns(np.zeros(na * nb), integer=False, upper=1.0)
    rows_a = b.rows(np.zeros(na), np.zeros(na))
    b.entries(rows_a[np.repeat(np.arange(na), nb)], w, 1.0)
    b.entries(rows_a[coupling.a_class[a_idx]], producer_cols, -1.0)
    rows_b = b.rows(np.zeros(nb), np.zeros(nb))
    b.entries(rows_b[np.tile(np.arange(nb), na)], w, 1.0)
    b.entries(rows_b[coupling.b_class[b_idx]], consumer_cols, -1.0)
    k = len(coupling.same_a)
    z = b.columns(np.zeros(k), integer=False, upper=1.0)
    for same, idx, node_cols in ((coupling.same_a, a_idx, producer_cols),
                                 (coupling.same_b, b_idx, consumer_cols)):
        # z[k] <= the node's choice of the k-th shared spec.
        rows = b.rows(np.full(k, -np.inf), np.zeros(k))
        b.entries(rows, z, 1.0)
        shared = np.full(int(idx.max()) + 1, -1)  # every distinct spec is some strategy's
        shared[same] = np.arange(k)
        picked = shared[idx] >= 0
        b.entries(rows[shared[idx][picked]], np.asarray(node_cols)[picked], -1.0)
    return np.concatenate((w, z))
