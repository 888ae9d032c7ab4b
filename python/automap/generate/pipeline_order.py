"""The order in which torch's pipeline schedules run one rank's forwards and
backwards (issue 18): what the stage simulation replays and what the
planner's in-flight microbatch counts are read from.

GPipe and 1F1B are written out here; interleaved 1F1B is torch's own
computation (``ScheduleInterleaved1F1B._calculate_single_rank_operations``:
its warm-up count and its one-forward-one-backward rank operations, private
helpers of ``torch.distributed.pipelining.schedules``), so the simulated order
is the one the runtime executes rather than a re-derivation of it."""

from __future__ import annotations

import functools

from torch.distributed.pipelining import schedules as _torch_schedules


def interleaved_rounds(microbatches: int, stages: int) -> int | None:
    """The rounds torch's interleaved 1F1B splits ``microbatches`` into on
    ``stages`` ranks (``max(1, M // n)``); None when they do not divide ``M``
    (torch's ``ScheduleInterleaved1F1B`` refuses such a count)."""
    rounds = max(1, microbatches // stages)
    return rounds if microbatches % rounds == 0 else None


def schedule_order(schedule: str, microbatches: int, stages: int, k: int,
                   virtual: int = 1) -> list[tuple[str, int, int]]:
    """Rank ``k``'s operations in one step (``stages`` ranks, ``virtual`` chunks
    each): ("F", i, chunk) and ("B", i, chunk) per microbatch ``i``, as torch's
    ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` run them
    (chunk ``j`` on rank ``j mod stages``; one chunk, ``k``, unless interleaved)."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i, k) for i in range(m)] + [("B", i, k) for i in range(m)]
    if schedule == "1f1b":
        warm = min(m, stages - k)
        order = [("F", i, k) for i in range(warm)]
        f = warm
        for b in range(m):
            order.append(("B", b, k))
            if f < m:
                order.append(("F", f, k))
                f += 1
        return order
    if schedule != "interleaved":
        raise ValueError(f"unknown schedule {schedule!r}")
    rounds = interleaved_rounds(m, stages)
    if rounds is None:
        raise ValueError(f"interleaved 1F1B cannot run {m} microbatches on {stages} ranks")
    per_round = m // rounds
    warmup = _torch_schedules._get_warmup_ops(k, virtual, per_round, stages, m,
                                              multiply_factor=2)
    total = virtual * m

    def forward_chunk(step: int) -> int:
        return (step // per_round) % virtual * stages + k

    def backward_chunk(step: int) -> int:
        return (virtual - 1 - ((step - warmup) // per_round) % virtual) * stages + k

    actions = _torch_schedules._get_1f1b_rank_ops(
        virtual, stages, warmup, total - warmup, warmup, k, forward_chunk, backward_chunk)
    return [("F" if a.computation_type == _torch_schedules._ComputationType.FORWARD else "B",
             int(a.microbatch_index), int(a.stage_index)) for a in actions if a is not None]


def in_flight_counts(schedule: str, microbatches: int, stages: int, virtual: int = 1
                     ) -> list[int]:
    """Per chunk (``stages * virtual``, chunk ``j`` on rank ``j mod stages``): the
    most microbatches whose forward it has run and whose backward it has not,
    over the step (the saved activations it holds at once)."""
    counts = [0] * (stages * virtual)
    for k in range(stages):
        live = [0] * (stages * virtual)
        for kind, _, chunk in schedule_order(schedule, microbatches, stages, k, virtual):
            live[chunk] += 1 if kind == "F" else -1
            counts[chunk] = max(counts[chunk], live[chunk])
    return counts


@functools.lru_cache(maxsize=256)
def held_at_once(schedule: str, microbatches: int, stages: int, virtual: int = 1
                 ) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Per rank, what its chunks hold together over the step, as the
    pareto-maximal pairs ``(in flight, backwards done)`` (one entry per chunk
    of the rank, chunk ``k + stages * i`` at ``i``) after each operation: a
    chunk's saved activations and received inputs are held per microbatch in
    flight, its input gradients per backward done (torch's runtime schedule
    waits for their sends at the end of the step). A rank's chunks reach
    their ``in_flight_counts`` at different operations (interleaved, M = 8 on
    2 ranks x 3 chunks: 4, 2 and 1 in flight on rank 1's chunks, never more
    than 5 together); every state of the step is dominated by one pair."""
    return [[(flight, done) for flight, done, _ in held]
            for held in _held(schedule, microbatches, stages, virtual, running=False)]


def held_while_running(schedule: str, microbatches: int, stages: int, virtual: int = 1
                       ) -> list[list[tuple[tuple[int, ...], tuple[int, ...], int]]]:
    """``held_at_once`` with the chunk that runs: per rank the pareto-maximal
    ``(in flight, backwards done, running)`` while each operation runs
    (``running`` the rank's chunk index ``i``), among states where the same
    chunk runs at the same stage of its backwards (none done yet, or some):
    a forward's state after it (its microbatch's activations all made), a
    backward's before it (its microbatch's still held). Only the running
    chunk's transients add to a state: counted for every chunk of the
    rank, the trust GPT-2's interleaved last rank modelled 14.8 % over its
    simulated step (the loss chunk's microbatch in flight beside another
    chunk's recomputation, which the schedule never runs at once)."""
    return _held(schedule, microbatches, stages, virtual, running=True)


def _counts(flight: dict, done: dict, mine: list[int]) -> tuple[int, ...]:
    return tuple(flight[c] for c in mine) + tuple(done[c] for c in mine)


def _held(schedule: str, microbatches: int, stages: int, virtual: int, running: bool):
    out = []
    for k in range(stages):
        mine = list(range(k, stages * virtual, stages))
        flight, done = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0)
        seen: set[tuple[tuple[int, ...], int]] = set()
        for kind, _, chunk in schedule_order(schedule, microbatches, stages, k, virtual):
            runs = mine.index(chunk) if running else -1
            if kind == "B" and running:
                seen.add((_counts(flight, done, mine), runs))
            flight[chunk] += 1 if kind == "F" else -1
            done[chunk] += kind == "B"
            if kind == "F" or not running:
                seen.add((_counts(flight, done, mine), runs))
        # A state is dominated only by one of larger sum with the same chunk
        # running as far into its backwards: keep those that no kept one
        # (taken by descending sum) dominates.
        maximal: list[tuple[tuple[int, ...], int]] = []
        for v, runs in sorted(seen, key=lambda s: sum(s[0]), reverse=True):
            key = (runs, runs >= 0 and v[virtual + runs] == 0)
            if not any((w_runs, w_runs >= 0 and w[virtual + w_runs] == 0) == key
                       and all(a >= b for a, b in zip(w, v)) for w, w_runs in maximal):
                maximal.append((v, runs))
        out.append([(v[:virtual], v[virtual:], runs) for v, runs in sorted(maximal)])
    return out
