"""Activation checkpointing on one device: the linearized stages of a traced
graph become a rotor chain (MAP Tables 1-2) priced from the profile, and the
rotor DP (rust/rotor) picks the fastest schedule within a memory budget.
Communication terms are zero here; the two-stage search adds them from a
plan's collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from automap import _core
from automap.linearize import linearize


@dataclass
class Chain:
    stages: list[list[str]]
    fwd_compute_s: list[float]
    bwd_compute_s: list[float]
    out_bytes: list[int]
    saved_bytes: list[int]
    fwd_tmp_bytes: list[int]
    bwd_tmp_bytes: list[int]


def _float_bytes(val) -> int:
    leaves = val if isinstance(val, (list, tuple)) else [val]
    return sum(t.numel() * t.element_size() for t in leaves
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def build_chain(traced, profile, flops_per_s: float) -> Chain:
    """Per stage: forward and backward compute seconds, the bytes of the
    activations it hands to later stages (``out``), the bytes it keeps for its
    own backward (``saved``, its output included), and its largest forward
    and backward temporaries."""
    stages = linearize(traced)
    stage_of = {name: k for k, stage in enumerate(stages) for name in stage}
    nodes = {n.name: n for n in traced.graph.nodes}
    chain = Chain(stages, [], [], [], [], [], [])
    for k, stage in enumerate(stages):
        profs = [profile.by_name[n] for n in stage if n in profile.by_name]
        chain.fwd_compute_s.append(sum(p.fwd_flops for p in profs) / flops_per_s)
        chain.bwd_compute_s.append(sum(p.bwd_flops for p in profs) / flops_per_s)
        # Activations read by a later stage cross the boundary.
        out = sum(_float_bytes(nodes[n].meta.get("val")) for n in stage
                  if any(stage_of.get(u.name, -1) > k for u in nodes[n].users))
        chain.out_bytes.append(out)
        chain.saved_bytes.append(out + sum(p.fwd_in_bytes for p in profs))
        chain.fwd_tmp_bytes.append(max([p.fwd_tmp_bytes for p in profs], default=0))
        chain.bwd_tmp_bytes.append(max([p.bwd_tmp_bytes + p.bwd_out_bytes for p in profs],
                                       default=0))
    return chain


def solve_checkpointing(chain: Chain, budget_bytes: int, slots: int = 500):
    """The rotor DP's fastest schedule of ``chain`` within ``budget_bytes`` of
    activation memory; raises ``InfeasibleBudgetError`` naming the least."""
    return _core.solve_rotor(
        chain.fwd_compute_s, chain.bwd_compute_s, chain.out_bytes, chain.saved_bytes,
        int(budget_bytes), fwd_tmp_bytes=chain.fwd_tmp_bytes, bwd_tmp_bytes=chain.bwd_tmp_bytes,
        slots=slots)
