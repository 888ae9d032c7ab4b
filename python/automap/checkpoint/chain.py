"""Activation checkpointing (MAP section 5.2): the linearized stages of a traced
graph become a rotor chain (the paper's Tables 1 and 2) priced under a
sharding plan, and the rotor DP (rust/rotor) picks the fastest schedule of
nested checkpoint regions within a memory budget.

Per stage and per device, under the strategies the plan chose:

- ``u_f``, ``u_b``: the nodes' local compute, split between forward and
  backward by their profiled FLOPs;
- ``u_fcomm``, ``u_bcomm``: the nodes' own collectives (partial-sum
  reductions forward, gradient reductions backward) and the layout
  conversions into them, forward and backward; a recomputed forward runs its
  collectives again and pays them again;
- memory from ``automap.solve.memory``'s model, the one the ILP bounds: ``ω_a``
  the local bytes of the stage's tensors that later stages read; ``ω_ā`` those
  plus what its nodes keep for the backward (less what they keep of earlier
  stages' outputs, held as ``a_k``); ``o_f``, ``o_b`` the largest forward and
  backward needs of its nodes (outputs, scratch, collective buffers,
  conversions); the parameter gradients (and bucket copies) its backward makes,
  which stay to the end; the state and inputs are the chain's persistent bytes.

On one device (mesh ``(1,)``) every communication term is zero.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from automap import _core
from automap.errors import StalePlanError
from automap.sharding.mesh import DeviceMesh
from automap.solve.linearize import linearize
from automap.solve.memory import estimate_memory, plan_memory, timeline
from automap.solve.strategies import ShardCounts, build_strategy_table

log = logging.getLogger(__name__)


@dataclass
class Chain:
    """The rotor chain of a plan: index-aligned per-stage lists."""

    stages: list[list[str]]
    fwd_compute_s: list[float] = field(default_factory=list)
    bwd_compute_s: list[float] = field(default_factory=list)
    fwd_comm_s: list[float] = field(default_factory=list)
    bwd_comm_s: list[float] = field(default_factory=list)
    out_bytes: list[int] = field(default_factory=list)
    saved_bytes: list[int] = field(default_factory=list)
    #: Beyond its output, what a forward that saves nothing holds transiently;
    #: beyond its saved set, what a saving forward does (a gathered weight is
    #: the first's temporary and in the second's saved set).
    fwd_tmp_bytes: list[int] = field(default_factory=list)
    save_fwd_tmp_bytes: list[int] = field(default_factory=list)
    bwd_tmp_bytes: list[int] = field(default_factory=list)
    #: Parameter gradients (and gradient bucket copies) the stage's backward
    #: makes; they stay live to the optimizer step.
    param_grad_bytes: list[int] = field(default_factory=list)
    #: Whether the stage keeps nothing of its input as produced, so that the
    #: output of a checkpointed region before it is freed after the stage's
    #: forward (``_frees_input``).
    frees_input: list[bool] = field(default_factory=list)
    #: Per device bytes that live through the whole step outside the chain:
    #: parameter and optimizer-state shards, buffers and inputs.
    persistent_bytes: int = 0
    #: Each trained parameter's shard in the optimizer's order (they size the
    #: optimizer step's temporaries; a tuple: not a per-stage column).
    param_shard_bytes: tuple[float, ...] = ()

    def __len__(self) -> int:
        return len(self.stages)


def build_chain(traced, profile, flops_per_s: float) -> Chain:
    """The chain of ``traced`` on one device (no sharding, no communication)."""
    table = build_strategy_table(traced, profile, DeviceMesh((1,)), flops_per_s=flops_per_s,
                                 optimizer=profile.optimizer)
    return chain_of_plan(traced, profile, table, {name: 0 for name in table.nodes})


def chain_of_plan(traced, profile, table, choice: dict[str, int],
                  repeats: dict[str, int] | None = None) -> Chain:
    """The chain of ``traced`` under the strategies ``choice`` picks from
    ``table`` (a ``StrategyTable`` priced with ``profile``), per device.

    ``repeats``: for depth-reduced planning (``automap.solve.depth``), how many real
    blocks each traced node's block stands for; each run of stages of such a
    block is repeated that many times, so the chain has the real depth."""
    stages = _cut_where_saved(linearize(traced), table, choice, profile)
    stage_of = {name: k for k, stage in enumerate(stages) for name in stage}
    graph_nodes = {n.name: n for n in traced.graph.nodes}
    mesh = table.mesh
    shard_count = ShardCounts(mesh)

    def local_bytes(info, spec: str) -> int:
        return int(info.nbytes // shard_count(spec))

    # Conversions into each consumer: forward and backward seconds.
    into: dict[str, list[tuple[float, float]]] = {}
    copied: set[tuple[str, int, str, int]] = set()
    for edge, _, _, path in table.conversions(choice):
        into.setdefault(edge[2], []).append((path.forward_cost_s, path.backward_cost_s))
        if any(step.kind != "shard" for step in path.steps):
            copied.add(edge)  # a gather or all-to-all makes a new tensor; a split may be a view

    line = timeline(table)
    mem = plan_memory(table, choice, line)
    held = plan_memory(table, choice, line, repeats) if repeats else mem
    grads_at = mem.grads + mem.buckets
    chain = Chain(stages)
    for k, stage in enumerate(stages):
        fc = bc = fm = bm = 0.0
        out = saved = grads = 0.0
        for name in stage:
            node = table.nodes.get(name)
            prof = profile.by_name.get(name)
            if node is None:
                continue
            c = choice[name]
            flops = (prof.fwd_flops + prof.bwd_flops) if prof is not None else 0
            fwd_share = prof.fwd_flops / flops if flops else 0.5
            fc += float(node.compute_s[c]) * fwd_share
            bc += float(node.compute_s[c]) * (1 - fwd_share)
            fm += float(node.forward_comm_s[c])
            bm += float(node.backward_comm_s[c])
            for f, b in into.get(name, []):
                fm, bm = fm + f, bm + b
            specs = node.out_specs[c]
            outs = [local_bytes(info, spec) for info, spec in zip(node.outputs, specs)]
            # Tensors read by a later stage cross the boundary.
            if any(stage_of.get(u.name, -1) > k for u in graph_nodes[name].users):
                crossing = sum(b for b, info in zip(outs, node.outputs) if info.is_float)
                out += crossing
                if _keeps_its_output(name, table, profile):
                    saved -= crossing  # its saved set already holds the output
            i = line.position.get(name)
            if i is None:
                continue
            saved += mem.saved[i]
            if node.saved_input_bytes is not None:
                # What it keeps of an earlier stage's output is that stage's a_k.
                saved -= sum(float(node.saved_input_bytes[c, j])
                             for j, (p, _) in enumerate(node.inputs)
                             if stage_of.get(p, k) < k)
            grads += grads_at[i]
        chain.fwd_compute_s.append(fc)
        chain.bwd_compute_s.append(bc)
        chain.fwd_comm_s.append(fm)
        chain.bwd_comm_s.append(bm)
        chain.out_bytes.append(int(out))
        chain.saved_bytes.append(int(out + max(0.0, saved)))
        chain.param_grad_bytes.append(int(grads))
    chain.frees_input = _frees_input(stages, table, choice, copied)
    chain.fwd_tmp_bytes, chain.save_fwd_tmp_bytes = _forward_overheads(chain, table, choice,
                                                                        line, mem)
    chain.bwd_tmp_bytes = _backward_overheads(chain, table, choice, line, mem)
    chain.persistent_bytes = int(held.state_bytes + held.input_bytes)
    chain.param_shard_bytes = tuple(held.param_shard_bytes)
    return _repeat_stages(chain, repeats) if repeats else chain


def _stage_positions(chain: Chain, line) -> list[list[int]]:
    """Per stage, the timeline positions of its nodes (those the memory model follows)."""
    return [[line.position[n] for n in stage if n in line.position] for stage in chain.stages]


def _forward_overheads(chain: Chain, table, choice, line, mem) -> tuple[list[int], list[int]]:
    """Per stage, what its forward needs beyond what the rotor counts there:
    (a forward that saves nothing, a saving forward). The first counts the
    stage's output: its overhead is the stage's largest transient less its
    output. The second counts the stage's whole saved set: its overhead is the
    memory model's peak over the stage's forwards less that (a large transient
    early in a stage comes before most of the stage's saved tensors). One
    overhead for both, the larger, counted a gathered weight twice in a saving
    forward, in the saved set and as a transient (benches/trust.py's MLP on
    (4,): each checkpointed plan modelled 1 MiB over its simulated step)."""
    model = estimate_memory(table, choice, line, table.optimizer).forward_bytes
    base = mem.state_bytes + mem.input_bytes
    saved_before = np.concatenate(([0], np.cumsum(chain.saved_bytes)[:-1]))
    plain_out, saving_out = [], []
    for k, positions in enumerate(_stage_positions(chain, line)):
        if not positions:
            plain_out.append(0)
            saving_out.append(0)
            continue
        saving = max(model[i] for i in positions) - (base + saved_before[k]
                                                     + chain.saved_bytes[k])
        plain = max(mem.fwd[i] for i in positions) - chain.out_bytes[k]
        plain_out.append(int(max(0.0, plain)))
        saving_out.append(int(max(0.0, saving)))
    return plain_out, saving_out


def _backward_overheads(chain: Chain, table, choice, line, mem) -> list[int]:
    """Per stage, what its backward needs beyond what the rotor counts there
    (the saved tensors of every stage so far, δ_{k+1} with the later parameter
    gradients, δ_k and the stage's own): the memory model's peak over the
    stage's nodes' backwards, less that. Inside a stage the saved tensors of
    later nodes are freed and waiting gradients come and go as the model
    follows them, so the chain that recomputes nothing peaks where the model
    does."""
    peak_at = estimate_memory(table, choice, line, table.optimizer).backward_bytes
    base = mem.state_bytes + mem.input_bytes
    later_grads = np.cumsum(chain.param_grad_bytes[::-1])[::-1].tolist() + [0]
    saved_so_far = np.cumsum(chain.saved_bytes)
    out = []
    for k, positions in enumerate(_stage_positions(chain, line)):
        if not positions:
            out.append(0)
            continue
        counted = (base + saved_so_far[k] + chain.out_bytes[k] + later_grads[k + 1]
                   + (chain.out_bytes[k - 1] if k else 0) + chain.param_grad_bytes[k])
        out.append(int(max(0.0, max(peak_at[i] for i in positions) - counted)))
    return out


def _frees_input(stages: list[list[str]], table, choice, copied) -> list[bool]:
    """Per stage: whether the stage lets go of its input once its forward has
    run, where that input is the output of a checkpointed region (which saved
    nothing of it): every floating tensor it reads from earlier stages is
    read by no later stage, and reaches each of its readers as a new tensor
    (a gathered or all-to-all copy) or is not saved by them (a residual add).
    A reader that is a view or writes in place may keep it alive: not freed.
    (The ResNet of the trust bench: a block saves an all-to-all copy of its
    input and adds the input itself at its end; the chain held the input to
    the block's backward, 8.6 % over the simulated step.)"""
    stage_of = {name: k for k, stage in enumerate(stages) for name in stage}
    readers: dict[str, list[tuple[str, int, str, int]]] = {}
    for edge in table.edges():
        readers.setdefault(edge[0], []).append(edge)
    frees = [False] * len(stages)
    for k in range(1, len(stages)):
        crossing = [(p, o, name, i) for name in stages[k] if name in table.nodes
                    for i, (p, o) in enumerate(table.nodes[name].inputs)
                    if stage_of.get(p, k) < k and table.nodes[p].outputs[o].is_float]
        ok = bool(crossing)
        for producer, o, consumer, i in crossing:
            later = any(stage_of.get(c, -1) > k for p, oo, c, _ in readers[producer] if oo == o)
            node = table.nodes[consumer]
            saved = node.saved_input_bytes is not None and i < node.saved_input_bytes.shape[1] \
                and node.saved_input_bytes[choice[consumer], i] > 0
            aliasing = node.kind == "view" or node.op.endswith("_")
            if later or aliasing or (saved and (producer, o, consumer, i) not in copied):
                ok = False
                break
        frees[k] = ok
    return frees


def _cut_where_saved(stages: list[list[str]], table, choice, profile) -> list[list[str]]:
    """``stages`` with each stage whose input nobody keeps for the backward merged
    into the one before: the rotor keeps a stage's input until its backward,
    which is what the program does only where something saves that tensor (a
    node of the stage, or the producer itself: a tanh, an in-place ReLU)."""
    stage_of = {name: k for k, stage in enumerate(stages) for name in stage}
    readers: dict[str, set[int]] = {}
    for producer, _, consumer, _ in table.edges():
        readers.setdefault(producer, set()).add(stage_of.get(consumer, -1))

    out: list[list[str]] = []
    for k, stage in enumerate(stages):
        keeps_input = False
        for name in stage:
            node = table.nodes.get(name)
            if node is None or node.saved_input_bytes is None:
                continue
            c = choice[name]
            keeps_input |= any(node.saved_input_bytes[c, j] > 0 and stage_of.get(p, k) < k
                               for j, (p, _) in enumerate(node.inputs))
        if k:
            keeps_input |= any(_keeps_its_output(name, table, profile) for name in stages[k - 1]
                               if any(r >= k for r in readers.get(name, ())))
        if out and not keeps_input:
            out[-1] = out[-1] + stage
        else:
            out.append(list(stage))
    return out


def _keeps_its_output(name: str, table, profile) -> bool:
    """Whether a node saves its own output for its backward (a tanh; an in-place
    ReLU, whose output is its input)."""
    prof = profile.by_name.get(name)
    if prof is None:
        return False
    in_place = table.nodes[name].op.endswith("_")
    return bool(prof.saved_output_bytes) or (in_place and bool(prof.saved_input_bytes))


def _repeat_stages(chain: Chain, repeats: dict[str, int]) -> Chain:
    out = Chain([], persistent_bytes=chain.persistent_bytes,
                param_shard_bytes=chain.param_shard_bytes)
    columns = [f for f in vars(chain) if isinstance(getattr(chain, f), list) and f != "stages"]
    times = [max((repeats.get(n, 1) for n in stage), default=1) for stage in chain.stages]
    k = 0
    while k < len(chain):
        end = k
        while end + 1 < len(chain) and times[end + 1] == times[k]:
            end += 1
        for _ in range(times[k]):  # the run of one block's stages, as a unit
            for i in range(k, end + 1):
                out.stages.append(chain.stages[i])
                for f in columns:
                    getattr(out, f).append(getattr(chain, f)[i])
        k = end + 1
    return out


def choice_of_plan(table, plan) -> dict[str, int]:
    """The strategy index per node of ``table`` that ``plan`` chose (to
    checkpoint or re-price a loaded plan)."""
    choice = {}
    for name, node in table.nodes.items():
        chosen = plan.nodes.get(name)
        if chosen is None:
            choice[name] = 0
            continue
        wanted = (tuple(chosen.inputs), tuple(chosen.outputs))
        matches = [i for i in range(len(node))
                   if (tuple(node.in_specs[i]), tuple(node.out_specs[i])) == wanted]
        if not matches:
            raise StalePlanError(f"the plan's strategy for {name} ({wanted}) is not one of the "
                                 "strategies of this graph on this mesh; re-plan")
        choice[name] = min(matches, key=lambda i: float(node.time_s[i]))
    return choice


#: Longest chain the rotor DP solves (its time grows as L^3): longer chains
#: are coarsened by merging neighbouring stages.
MAX_STAGES = 200


def coarsen(chain: Chain, max_stages: int = MAX_STAGES) -> Chain:
    """``chain`` with runs of consecutive stages merged so that at most
    ``max_stages`` remain (cut where the forward time is evenly split). A
    merged stage keeps everything its parts save, hands on its last part's
    output, and its temporaries are its parts' largest (with their output,
    which is live inside the merged stage: a conservative bound)."""
    if len(chain) <= max_stages:
        return chain
    weights = [f + b + 1e-12 for f, b in zip(chain.fwd_compute_s, chain.bwd_compute_s)]
    total, groups, start, acc = sum(weights), [], 0, 0.0
    for k, w in enumerate(weights):
        acc += w
        remaining_groups = max_stages - len(groups) - 1
        # Cut at each even share of the time, or where every later stage must
        # be a group of its own to reach max_stages.
        if remaining_groups > 0 and (acc >= total * (len(groups) + 1) / max_stages
                                     or len(chain) - k - 1 <= remaining_groups):
            groups.append((start, k))
            start = k + 1
    if start < len(chain):
        groups.append((start, len(chain) - 1))
    out = Chain([], persistent_bytes=chain.persistent_bytes,
                param_shard_bytes=chain.param_shard_bytes)
    for lo, hi in groups:
        parts = range(lo, hi + 1)
        out.stages.append([n for k in parts for n in chain.stages[k]])
        for f in ("fwd_compute_s", "bwd_compute_s", "fwd_comm_s", "bwd_comm_s", "saved_bytes",
                  "param_grad_bytes"):
            getattr(out, f).append(sum(getattr(chain, f)[k] for k in parts))
        out.out_bytes.append(chain.out_bytes[hi])
        if chain.frees_input:  # a merged stage's input is its first part's
            out.frees_input.append(chain.frees_input[lo])
        for f in ("fwd_tmp_bytes", "bwd_tmp_bytes"):
            getattr(out, f).append(max(getattr(chain, f)[k] + chain.out_bytes[k] for k in parts))
        # A merged stage saves all its parts: each part's forward runs with the
        # parts before it saved, and its own overhead beyond its saved set.
        before = 0
        saving = 0
        for k in parts:
            saving = max(saving, before + chain.saved_bytes[k] + chain.save_fwd_tmp_bytes[k])
            before += chain.saved_bytes[k]
        out.save_fwd_tmp_bytes.append(max(0, saving - before))
    return out


@dataclass
class Schedule:
    """A rotor schedule: ``ops`` ((op, stage) in order), nested ``blocks``
    (``start_stage``, ``end_stage``, ``children``), seconds and bytes."""

    ops: list[tuple[str, int]]
    blocks: list
    predicted_time_s: float
    no_recompute_time_s: float
    peak_memory_bytes: int
    budget_bytes: int
    op_memory_bytes: list[int]
    recomputed_forwards: int

    @property
    def recompute_time_s(self) -> float:
        if not self.recomputed_forwards:
            return 0.0
        return max(0.0, self.predicted_time_s - self.no_recompute_time_s)


def solve_checkpointing(chain: Chain, activation_budget_bytes: int, slots: int = 500
                        ) -> Schedule:
    """The rotor DP's fastest schedule of ``chain`` with at most
    ``activation_budget_bytes`` of activations, temporaries and gradients of
    activations live per device; raises ``InfeasibleBudgetError`` naming the
    least activation budget that fits."""
    # Every forward costs a little more: among equally fast schedules (stages
    # of views cost nothing to recompute) one with fewer recomputations wins.
    # The DP's table is f32 (relative error ~1e-5 of the chain's time). The
    # extra is taken out of the times reported.
    total_s = sum(chain.fwd_compute_s) + sum(chain.bwd_compute_s) + sum(chain.fwd_comm_s)
    tie_s = 3e-5 * total_s or 1e-12
    start_s = time.perf_counter()
    found = _core.solve_rotor(
        [f + tie_s for f in chain.fwd_compute_s], chain.bwd_compute_s, chain.out_bytes,
        chain.saved_bytes,
        int(activation_budget_bytes), fwd_comm_s=chain.fwd_comm_s, bwd_comm_s=chain.bwd_comm_s,
        fwd_tmp_bytes=chain.fwd_tmp_bytes, save_fwd_tmp_bytes=chain.save_fwd_tmp_bytes,
        bwd_tmp_bytes=chain.bwd_tmp_bytes,
        param_grad_bytes=chain.param_grad_bytes,
        frees_input=chain.frees_input or None, slots=slots)
    forwards = sum(1 for op, _ in found.ops if op != "backward")
    log.debug("rotor DP: %d stages within %d bytes, %d forwards recomputed, %.2f s", len(chain),
              activation_budget_bytes, forwards - len(chain), time.perf_counter() - start_s)
    return Schedule(list(found.ops), list(found.blocks),
                    found.predicted_time_s - tie_s * forwards,
                    found.no_recompute_time_s - tie_s * len(chain),
                    found.peak_memory_bytes, found.budget_bytes, list(found.op_memory_bytes),
                    forwards - len(chain))
