"""Stage boundaries by dynamic programming: the chain's units
(``pipeline_chain``) split into ``n`` contiguous stages minimising the
schedule's step

    latency(sum(t_k), max(t_k)) + max_k max(0, sync_k - drain_k)
        + max_k(optimizer_k) + tied_s

(``schedule_step_s``: ``sum(t_k) + (M - 1) * max(t_k)`` on devices of
their own)

(interleaved 1F1B over ``n * v`` chunks: ``sum(t_j) / v + (M v - 1) max(t_j)``,
``schedule_step_s``; chunk ``j`` on submesh ``j mod n``, the per-rank tail
summed over the rank's chunks, the rank's peak from what its chunks hold
together, ``rank_peaks``)

with ``t_k`` stage ``k``'s forward and backward of one microbatch plus its
sends (the activations to ``k + 1``, the gradient back to ``k - 1``), each
stage's peak memory under the budget. GPipe and 1F1B share the latency;
they differ in the microbatches in flight: GPipe keeps all ``M``
microbatches' saved activations, 1F1B at most ``n - k`` on stage ``k``.
A stage whose activations do not fit may recompute: its forward runs again
before its backward (one more forward per microbatch), keeping only its
input per microbatch in flight and one microbatch's activations at a time.

The max term makes the objective non-additive: for a cap ``T`` on every
``t_k``, the least ``sum(t_k)`` is a plain DP (``O(n K^2)`` vectorised), and
the optimum is the best over caps taken from the stage times themselves,
ascending from the least feasible cap until ``(M - 1) * T`` alone outweighs
the best found. Where ranks share their compute the split is still chosen
so (the shared latency cannot tell balanced from unbalanced stages of
equal sum) and the step reported is ``schedule_step_s``'s shared one. The
gradient sync (``stage_sync_s``, less the drain after the stage's last
backward: ``drain_k``, the backward of stages ``k - 1 .. 0``), the optimizer
step and the tied weights'
all-reduce are added after the DP (they are small next to the microbatches
and nearly the same for every split).

``best_mixed_split`` runs the same DP over several submesh plans' chains at
once, each chunk taking the fastest plan that fits it (``pipeline_merge``
makes one plan of the choice)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from automap.generate.pipeline_order import held_while_running, in_flight_counts
from automap.planner.pipeline_chain import Chain
from automap.planner.pipeline_mesh import StageMeshes
from automap.sharding.collectives import DEFAULT_BUCKET_BYTES
from automap.solve.memory import optimizer_temporaries

#: At most this many caps are tried above the least feasible one.
MAX_CAPS = 4000


@dataclass
class Partition:
    bounds: list[tuple[int, int]]  # per stage, units [a, b)
    forward_s: list[float]  # per stage and microbatch, with the send to the next stage
    backward_s: list[float]  # with the gradient's send to the previous stage
    peak_bytes: list[float]
    send_s: list[float]  # per boundary, one microbatch's activations forward
    tail_s: float  # gradient sync and optimizer after the last microbatch
    tied_s: float  # tied weights' gradient all-reduce between stages
    step_s: float
    #: Per stage: it recomputes its forward in the backward (activation
    #: checkpointing of the whole stage: only its input is kept per microbatch).
    recompute: list[bool]
    #: Chunks per rank (interleaved; 1 otherwise): ``bounds`` has ``n * virtual``.
    virtual: int = 1


def in_flight(schedule: str, microbatches: int, stages: int, k: int, virtual: int = 1) -> int:
    """Microbatches whose saved activations stage (chunk) ``k`` holds at once
    (interleaved: read from torch's order of the rank's operations)."""
    if schedule == "interleaved":
        return in_flight_counts(schedule, microbatches, stages, virtual)[k]
    return microbatches if schedule == "gpipe" else min(microbatches, stages - k)


def _flights(schedule: str, microbatches: int, stages: int, virtual: int) -> list[int]:
    """Per chunk, the microbatches in flight (``in_flight``; interleaved: all
    ``stages * virtual`` chunks' from torch's order at once)."""
    if virtual > 1:
        return in_flight_counts(schedule, microbatches, stages, virtual)
    return [in_flight(schedule, microbatches, stages, k) for k in range(stages)]


def schedule_step_s(sum_s: float, max_s: float, microbatches: int, virtual: int = 1,
                    shared_slowdown: float = 1.0, submeshes: int = 1) -> float:
    """The schedule's step over ``microbatches`` from the sum ``sum_s`` and the
    largest ``max_s`` of the chunk times ``t`` (forward + backward + sends of
    one microbatch per chunk, ``virtual`` chunks per rank):
    ``sum(t) / v + (M v - 1) max(t)``.

    GPipe and 1F1B (``v = 1``): ``sum(t) + (M - 1) max(t)``, the first
    microbatch through every stage and the other ``M - 1`` at the slowest
    stage's pace. Interleaved 1F1B runs ``M v`` chunk operations per rank in
    lockstep slots paced by the slowest chunk (as 1F1B's steady state is paced
    by its slowest stage), and its fill and drain cost one pass over the
    ``n`` chunks of one round, ``sum(t) / v``: with equal chunks ``c``,
    ``(M v + n - 1) c``, Megatron's bubble of ``(n - 1) c``, ``v`` times
    smaller than 1F1B's ``(n - 1) v c`` for the same per-rank work.

    Ranks that share their compute (``DeviceProfile.shared_slowdown`` > 1, the
    chunk times priced with every rank computing) run faster while others
    idle in the bubbles: the schedule runs up to that many times faster, but
    the machine cannot do more work than all ranks busy at once do, so the
    step is at least a rank's mean work ``M * sum_s / submeshes``. With a
    device per rank (1) the first term is always the larger."""
    latency = sum_s / virtual + (microbatches * virtual - 1) * max_s
    if shared_slowdown <= 1.0:
        return latency
    return max(latency / shared_slowdown, microbatches * sum_s / submeshes)


class _Ranges:
    """Per unit range ``[a, b)`` (matrices indexed ``[a, b]``) the sums and maxima
    the stage costs need."""

    def __init__(self, chain: Chain) -> None:
        units = chain.units
        self.K = k = len(units)

        def sums(values) -> np.ndarray:
            c = np.concatenate([[0.0], np.cumsum(values)])
            return c[None, :] - c[:, None]

        def maxima(values) -> np.ndarray:
            out = np.zeros((k + 1, k + 1))
            for a in range(k):
                out[a, a + 1:] = np.maximum.accumulate(np.asarray(values[a:], dtype=float))
            return out

        self.compute = sums([u.forward_s for u in units]), sums([u.backward_s for u in units])
        self.saved = sums([u.saved_bytes for u in units])
        self.transient = maxima([u.transient_bytes for u in units])
        self.accumulating = maxima([u.accumulating_bytes for u in units])
        # What one microbatch of units [a, b) holds while one of its nodes
        # runs: every earlier unit's saved tensors and the running unit's
        # ``Unit.running_bytes`` (at most ``saved + transient``: charged as
        # that, a recomputing GPT-2 chunk modelled 13-19 % over its
        # simulation); in the chunk's first backward, with the parameter
        # gradients of the later units too (``first_running_bytes``).
        before = np.concatenate([[0.0], np.cumsum([u.saved_bytes for u in units])])
        made = np.concatenate([[0.0], np.cumsum([u.made_bytes for u in units])])

        def running(values, later) -> np.ndarray:
            out = maxima(before[:-1] - later[1:] + np.asarray(values, dtype=float)) \
                - before[:, None] + later[None, :]
            out[np.tril_indices(k + 1)] = 0.0  # empty ranges
            return out

        self.counts_waiting = all(u.running_bytes is not None for u in units)
        fallback = [u.saved_bytes + max(u.transient_bytes, u.accumulating_bytes)
                    for u in units]
        self.running = running([f if u.running_bytes is None else u.running_bytes
                                for u, f in zip(units, fallback)], np.zeros(k + 1))
        self.first_running = running(
            [f if u.first_running_bytes is None else u.first_running_bytes
             for u, f in zip(units, fallback)], made)
        self.loop_temp = maxima([u.loop_temp_bytes for u in units])
        #: (id of the stage meshes, chunks) -> the send times after each unit,
        #: forward and back (``_stage_matrices``).
        self.sends: dict = {}
        #: The largest output gradient a chunk ending after some unit receives.
        self.out_grad_max = float(max([u.out_grad_bytes for u in units[:-1]], default=0.0))
        # State read by one unit adds up; state read by several counts once per stage.
        users: dict = {}
        for i, unit in enumerate(units):
            for key in unit.state:
                users.setdefault(key, []).append(i)
        single, single_grads = np.zeros(k), np.zeros(k)
        self.shared: list[tuple[object, list[int], float]] = []
        shared_grads = []
        for key, where in users.items():
            held, grad = units[where[0]].state[key]
            if len(where) == 1:
                single[where[0]] += held + grad
                single_grads[where[0]] += grad
            else:
                self.shared.append((key, where, held + grad))
                shared_grads.append(grad)
        self.state = sums(single)
        #: The parameter gradients within ``state``: none before a stage's
        #: first backward (``holding_sets``).
        self.grads = sums(single_grads)
        for (_, where, nbytes), grad in zip(self.shared, shared_grads):
            count = np.zeros(k)
            count[where] = 1
            self.state += nbytes * (sums(count) > 0)
            self.grads += grad * (sums(count) > 0)
        #: The data-parallel gradients' bucket copies, all live at once while
        #: the chunk syncs them after its last backward (``GradientSync.deferred``
        #: launches every bucket, then waits); each gradient once per chunk.
        synced: dict = {}
        for i, unit in enumerate(units):
            for key, (_, nbytes) in unit.sync.items():
                synced.setdefault(key, (nbytes, []))[1].append(i)
        self.sync = np.zeros((k + 1, k + 1))
        for nbytes, where in synced.values():
            count = np.zeros(k)
            count[where] = 1
            self.sync += nbytes * (sums(count) > 0)


@dataclass
class ChunkMemory:
    """A chunk's memory matrices (``[a, b]``: its units), as ``_stage_matrices``
    builds them: per microbatch in flight (keeping its activations, or
    recomputing them) and per backward done, the fixed bytes, the moment
    while it runs (likewise; in its first backward and in a later one), the
    optimizer step's state and temporary, and
    where the split tried recomputes."""

    index: int
    fixed: np.ndarray
    grads: np.ndarray  # within ``fixed``, none before the chunk's first backward
    per_flight: tuple[np.ndarray, np.ndarray]  # (kept, recomputed)
    per_done: np.ndarray | float
    #: (kept, recomputed), each (in the chunk's first backward, later).
    moment: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
    step_base: np.ndarray
    step_temporary: np.ndarray
    recomputes: np.ndarray
    holdings: list  # the schedule's (``holding_sets``' last), for the reported peak

    def at(self, a: int, b: int, lean: bool | None = None
           ) -> tuple[list[float], list[float], float, float]:
        """``(bases, moments, step base, step temporary)`` of units ``[a, b)``,
        one base and one moment per holding (``rank_peaks``); ``lean``:
        recomputing (default: as the split tried)."""
        k = self.index
        lean = bool(self.recomputes[a, b]) if lean is None else lean
        shape = self.fixed.shape
        fixed, grads, flight, done, first, later = (
            float(np.broadcast_to(m, shape)[a, b])
            for m in (self.fixed, self.grads, self.per_flight[lean], self.per_done,
                      *self.moment[lean]))
        bases = [fixed - (grads if h.done[k] == 0 else 0.0) + h.flight[k] * flight
                 + h.done[k] * done for h in self.holdings]
        moments = [(first if h.done[k] == 0 else later)
                   if h.running is None or h.running[k] else 0.0 for h in self.holdings]
        return bases, moments, float(self.step_base[a, b]), float(self.step_temporary[a, b])


@dataclass
class Holding:
    """What every chunk holds at once at some point of the step (``chunks``
    entries, chunk ``j`` on rank ``j mod n``): ``flight[j]`` microbatches'
    saved activations and received inputs, ``done[j]`` backwards done (their
    input gradients waiting for their sends, interleaved; its parameter
    gradients only after the first); each chunk within ``shares[j]`` of its rank's
    budget (a rank's shares sum to 1, so a split within them keeps the rank's
    sum within its budget)."""

    flight: list[int]
    done: list[int]
    shares: list[float]
    #: Per chunk, whether it is the one its rank runs then (None: any may be,
    #: the largest transient counts): the schedule's own states know.
    running: list[bool] | None = None


def _weighted(ranges: _Ranges, flight: list[int], n: int) -> list[float]:
    """Shares in proportion to what an even cut's chunk would hold (its share
    of the state, ``flight[j]`` times its share of the saved activations, the
    largest transient): a rank's first chunks, which keep the most
    microbatches, get more."""
    chunks, k = len(flight), ranges.K
    virtual = chunks // n
    state, saved = ranges.state[0, k] / chunks, ranges.saved[0, k] / chunks
    demand = [state + f * saved + ranges.transient[0, k] for f in flight]
    rank = [sum(demand[r::n]) for r in range(n)]
    return [d / rank[j % n] if rank[j % n] > 0 else 1 / virtual for j, d in enumerate(demand)]


def holding_sets(ranges: _Ranges, schedule: str, microbatches: int, n: int,
                 virtual: int) -> list[list[Holding]]:
    """The sets of holdings the DP tries, each chunk within all of a set's:
    GPipe and 1F1B, each stage's in-flight count (one chunk per rank);
    interleaved, each chunk's most in flight and all ``M`` gradients waiting
    at equal and at weighted shares, and the holdings a rank's chunks reach
    together (``pipeline_order.held_while_running``, weighted shares, with
    the chunk each rank runs then): the most in flight are reached at
    different operations, and their sum over-counts (GPT-2 on 2 ranks x 3
    chunks, M = 8: 7 microbatches against 5 held)."""
    chunks = n * virtual
    flights = _flights(schedule, microbatches, n, virtual)
    if virtual == 1:
        # Before the first backward: every microbatch in flight, no parameter
        # gradient yet; after it, the gradients and as many in flight as
        # another forward brings back (1F1B's steady state) or one fewer
        # (GPipe, or 1F1B where all M are in flight at once). Counted
        # together, GPT-2's last stage under GPipe modelled 5.8 % over.
        after = [f if microbatches > f else f - 1 for f in flights]
        return [[Holding(flights, [0] * chunks, [1.0] * chunks),
                 Holding(after, [1] * chunks, [1.0] * chunks)]]
    waiting = [microbatches] * chunks
    most = [Holding(flights, waiting, [1 / virtual] * chunks),
            Holding(flights, waiting, _weighted(ranges, flights, n))]
    per_rank = held_while_running(schedule, microbatches, n, virtual)
    together = []
    for p in range(max(len(h) for h in per_rank)):
        flight, done, running = [0] * chunks, [0] * chunks, [False] * chunks
        for r, held in enumerate(per_rank):
            inflight, backwards, runs = held[min(p, len(held) - 1)]
            for i in range(virtual):
                flight[r + n * i], done[r + n * i] = inflight[i], backwards[i]
            running[r + n * runs] = True
        together.append(Holding(flight, done, _weighted(ranges, flight, n), running))
    return [[most[0]], [most[1]], together]


def _stage_matrices(chain: Chain, ranges: _Ranges, stages: StageMeshes, microbatches: int,
                    schedule: str, budget, optimizer, recompute: bool, virtual: int = 1,
                    holdings: list[Holding] | None = None, reserve: float | None = None):
    """Per chunk index ``j`` (the stage, unless interleaved: chunk ``j`` on
    submesh ``j mod n``): the time matrix ``t[a, b]`` (inf where the range is
    empty or over the budget: one for all ranks or one per submesh, a chunk
    within its share of its rank's under each of ``holdings``, default
    ``holding_sets``' first) and its memory (``ChunkMemory``, with where the
    chunk recomputes its forward to fit; ``recompute``: allowed).
    ``reserve`` (interleaved): bytes of each rank's budget set aside for
    the one chunk running, each chunk's base and the part of its moment
    above the reserve within its share of the rest (the optimizer's largest
    temporary likewise); None: base and moment within the share."""
    n, k_units = stages.count, ranges.K
    chunks = n * virtual
    units = chain.units
    empty = np.tril(np.ones((k_units + 1, k_units + 1), dtype=bool))
    # A chunk without a trainable parameter is no stage: its rank would hold
    # nothing to optimise (a one-layer model cut in 2 left the loss alone, and
    # the usual AdamW(model.parameters()) failed on that rank only).
    trains = np.concatenate([[0], np.cumsum([u.trains for u in units])])
    empty |= trains[None, :] - trains[:, None] <= 0
    _, of_all = optimizer_temporaries(optimizer, chain.optimizer_impl)
    def per_cut(values) -> np.ndarray:
        """Per unit after which a cut falls -> per cut position (0: none before)."""
        return np.concatenate([[0.0], values])

    # Chunk j sends to chunk j + 1 on submesh (j + 1) mod n (the last submesh
    # wraps to the first), and its input's gradient back to (j - 1) mod n.
    key = (id(stages), chunks)  # the same for every budget the search tries
    if key not in ranges.sends:
        ranges.sends[key] = (
            np.array([[stages.send_s(j % n, (j + 1) % n, u.out_bytes) for u in units]
                      for j in range(chunks - 1)]).reshape(chunks - 1, k_units),
            np.array([[stages.send_s(j % n, (j - 1) % n, u.out_grad_bytes) for u in units]
                      for j in range(1, chunks)]).reshape(chunks - 1, k_units))
    send_fwd, send_bwd = ranges.sends[key]
    times, parts = [], []
    per_stage = budget if isinstance(budget, (list, tuple)) else [budget] * n
    sets = holding_sets(ranges, schedule, microbatches, n, virtual)
    holdings = holdings or sets[0]
    reported = sets[-1]  # the tightest the schedule allows, for the peaks
    # What crosses after unit b - 1 (a chunk's end, column b; its start, row a).
    crossing = per_cut([u.out_bytes for u in units])
    crossing_grad = per_cut([u.out_grad_bytes for u in units])
    unsaved = per_cut([u.out_unsaved_bytes for u in units])
    uncounted = per_cut([u.out_uncounted_bytes for u in units])
    # The running microbatch: with its activations kept (``flight`` counts
    # them saved), what its running node adds; recomputed, all it holds then.
    # In the chunk's first backward (no gradient held before it) and in a
    # later one (each parameter's gradient made anew beside the one
    # accumulated): ``Unit.first_running_bytes`` and ``running_bytes``.
    running = (ranges.first_running, ranges.running)
    # The optimizer's for-loop steps one parameter at a time: its temporaries
    # are one parameter's (with what it holds of the one before: the units'
    # ``loop_temp_bytes``), once per rank however many chunks it runs;
    # its foreach kernels make theirs for every parameter of the rank at once
    # (in each chunk's step base, which add up over the rank's chunks). Before
    # it, each chunk in turn holds its gradients' bucket copies (a rank's
    # chunks sync one after another): the step's moment is the larger of the
    # two beyond the base. Left out, a 1F1B stage whose 3 layers sync 2-way
    # modelled 6.3 % under its simulated step (DeepMLP(256), 4 microbatches).
    foreach_temporary = of_all * ranges.grads
    step_temporary = np.maximum(ranges.loop_temp, ranges.sync - foreach_temporary)
    step_reserve = float(step_temporary.max())
    for k in range(chunks):
        budget = per_stage[k % n]
        t = ranges.compute[0] + ranges.compute[1]
        if k < chunks - 1:  # the activations at the chunk's end go to the next chunk
            t = t + per_cut(send_fwd[k])[None, :]
        if k > 0:  # the gradient at its start goes back
            t = t + per_cut(send_bwd[k - 1])[:, None]
        # The point-to-point buffers the schedules hold (``simulate_pipeline``):
        # each microbatch in flight keeps its received input until its backward
        # (where no node of the chunk counts it saved); the outputs no node of
        # the chunk saves wait for their sends (GPipe: every microbatch's until
        # its last forward; interleaved: each until its backward on the chunk;
        # 1F1B: the last forward's, until the next operation); in a backward
        # the output's gradient is received and the last backward's input
        # gradient waits for its send (interleaved: every backward's until the
        # end of the step, where torch's runtime schedule waits for them).
        # Left out, GPipe's 4 stages of a 256-wide MLP simulated 27 % over the
        # model.
        last = k == chunks - 1
        received = uncounted[:, None] if k > 0 else 0.0
        unsent = 0.0 if last else unsaved[None, :]
        # Counted among the running unit's waiting gradients where the chain
        # has them (``Unit.running_bytes``).
        out_grad = 0.0 if last or ranges.counts_waiting else crossing_grad[None, :]
        in_grad = crossing_grad[:, None] if k > 0 else 0.0
        # Every rank holds the whole batch the caller passes (counted once, on
        # its first chunk).
        held = microbatches * chain.input_bytes if k < n else 0.0
        fixed = held + ranges.state
        # Recomputed: each microbatch in flight keeps only the stage's input; one
        # microbatch's activations come back while its backward runs.
        inputs = crossing[:, None]
        if virtual > 1:
            # A rank runs one chunk at a time: what a chunk holds between its
            # operations (base: per microbatch in flight its saved tensors,
            # received input and unsent output; per backward done its input
            # gradient) adds up over the rank's chunks at each holding; what it
            # holds only while it runs (moment: its transients, the output
            # gradient received) counts once per rank (``rank_peaks``). Summed
            # per chunk at each one's most in flight, the 256-wide MLP's and
            # GPT-2's interleaved ranks modelled 13-28 % over their simulation.
            per_mb, lean_per_mb, per_done = ranges.saved + received + unsent, \
                inputs + unsent, in_grad
            moment = tuple(r - ranges.saved + out_grad for r in running)
            lean_moment = tuple(r + out_grad for r in running)
        else:
            # GPipe's sends are done before the first backward, 1F1B's at the
            # next operation: the backward's buffers come after them.
            sends = unsent * (microbatches if schedule == "gpipe" else 1)
            per_mb, lean_per_mb, per_done = ranges.saved + received, inputs, 0.0
            moment = tuple(np.maximum(sends, r - ranges.saved + out_grad + in_grad)
                           for r in running)
            lean_moment = tuple(np.maximum(sends, r + out_grad + in_grad) for r in running)
        step_base = fixed + foreach_temporary
        if virtual == 1 and k > 0:
            # The last microbatch's received input and its gradient are still
            # held when the optimizer steps (the simulated stage keeps them;
            # left out, the 256-wide MLP's last 1F1B stage modelled 6.6 % under).
            step_base = step_base + crossing[:, None] + crossing_grad[:, None]
        if budget is None:
            fits = ~empty
            lean_fits = np.zeros_like(empty)
        else:
            fits, lean_fits = ~empty, ~empty & recompute
            # The moments above the rank's reserve are held in the chunk's
            # share: whichever chunk runs, the rank holds every base and at
            # most the reserve beyond them.
            spare = reserve or 0.0
            step_spare = step_reserve if reserve else 0.0
            over = [np.maximum(m - spare, 0.0) for m in moment]
            lean_over = [np.maximum(m - spare, 0.0) for m in lean_moment]
            step_over = np.maximum(step_temporary - step_spare, 0.0)
            # Holdings alike on this chunk constrain it alike.
            for flight, done, part in {(h.flight[k], h.done[k], h.shares[k]) for h in holdings}:
                share = budget * part
                held_state = fixed - (ranges.grads if done == 0 else 0.0) + done * per_done
                base = held_state + flight * per_mb
                lean_base = held_state + flight * lean_per_mb
                room = share - spare * part
                steps = step_base + step_over <= share - step_spare * part
                running_now = 0 if done == 0 else 1  # the first backward, or a later one
                fits = fits & (base + over[running_now] <= room) & steps
                lean_fits = lean_fits & (lean_base + lean_over[running_now] <= room) & steps
            lean_fits &= ~fits
        times.append(np.where(fits, t, np.where(lean_fits, t + ranges.compute[0], np.inf)))
        parts.append(ChunkMemory(k, fixed, ranges.grads, (per_mb, lean_per_mb), per_done,
                                 (moment, lean_moment), step_base, step_temporary,
                                 lean_fits, reported))
    return times, parts


def _least_sum(times: list[np.ndarray], cap: float):
    """The split of least ``sum(t_k)`` with every ``t_k <= cap``: (sum, bounds) or
    (inf, None)."""
    k_units = times[0].shape[0] - 1
    best = np.full(k_units + 1, np.inf)
    best[0] = 0.0
    choices = []
    for t in times:
        total = best[:, None] + np.where(t <= cap, t, np.inf)
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(k_units + 1)]
        choices.append(arg)
    if not np.isfinite(best[k_units]):
        return np.inf, None
    bounds, b = [], k_units
    for arg in reversed(choices):
        a = int(arg[b])
        bounds.append((a, b))
        b = a
    return float(best[k_units]), bounds[::-1]


def best_partition(chain: Chain, stages: StageMeshes, microbatches: int, schedule: str,
                   budget, optimizer="adamw",
                   recompute: bool = True, virtual: int = 1,
                   shared_slowdown: float = 1.0) -> Partition | None:
    """The fastest split of ``chain`` over ``stages`` (see the module docstring);
    None when there are fewer units than chunks or no split fits ``budget`` (bytes
    per device: one for every stage, a list of one per stage index, or None).
    ``recompute``: a stage that does not fit may recompute its forward.
    ``virtual``: chunks per rank (interleaved; ``n * virtual`` chunks, chunk
    ``j`` on submesh ``j mod n``, each within its share of its rank's budget,
    ``_memory_splits``: the fastest split over the sets of shares and
    reserves).
    ``shared_slowdown``: the device profile's, for the reported step
    (``schedule_step_s``; the split is chosen as for a device per rank)."""
    ranges = _Ranges(chain)
    n = stages.count
    if ranges.K < n * virtual:
        return None
    best = None
    splits = _memory_splits(chain, ranges, stages, microbatches, schedule, optimizer,
                            virtual) if budget is not None else [(None, None)]
    for holdings, reserve in splits:
        found = _best_within(chain, ranges, stages, microbatches, schedule, budget, optimizer,
                             recompute, virtual, shared_slowdown, holdings, reserve)
        if found is not None and (best is None or found.step_s < best.step_s):
            best = found
    return best


#: The least budget is bisected to this share of itself.
LEAST_TOLERANCE = 1e-4


def least_budget(chain: Chain, stages: StageMeshes, microbatches: int, schedule: str,
                 optimizer="adamw", virtual: int = 1, recompute: bool = True) -> float | None:
    """The least budget (bytes per device, the partition model's) within which
    some split of ``chain`` fits, stages recomputing where that helps (and
    ``recompute`` allows): the
    smallest ``budget`` for which ``best_partition`` finds a split, to
    ``LEAST_TOLERANCE`` (bisected: a larger budget only admits more splits).
    None when there are fewer units than chunks."""
    ranges = _Ranges(chain)
    n = stages.count
    if ranges.K < n * virtual:
        return None
    splits = _memory_splits(chain, ranges, stages, microbatches, schedule, optimizer,
                            virtual)

    def fits(budget: float) -> bool:
        return any(_least_sum(_stage_matrices(chain, ranges, stages, microbatches, schedule,
                                              budget, optimizer, recompute, virtual, holdings,
                                              reserve)[0],
                              np.inf)[1] is not None
                   for holdings, reserve in splits)

    free = best_partition(chain, stages, microbatches, schedule, None, optimizer,
                          recompute=recompute, virtual=virtual)
    if free is None:
        return None
    hi = max(free.peak_bytes)
    for _ in range(64):  # interleaved chunks within their shares may need more
        if fits(hi):
            break
        hi *= 2
    else:  # pragma: no cover - every split fits some finite budget
        return None
    lo = 0.0
    while hi - lo > LEAST_TOLERANCE * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _best_within(chain: Chain, ranges: _Ranges, stages: StageMeshes, microbatches: int,
                 schedule: str, budget, optimizer, recompute: bool, virtual: int,
                 shared_slowdown: float, holdings: list[Holding] | None,
                 reserve: float | None) -> Partition | None:
    """``best_partition`` with each chunk within its shares of its rank's
    budget under ``holdings`` (and ``reserve``, ``_stage_matrices``)."""
    times, parts = _stage_matrices(chain, ranges, stages, microbatches, schedule,
                                               budget, optimizer, recompute, virtual, holdings,
                                               reserve)
    bounds = _fastest_bounds(times, microbatches, virtual)
    if bounds is None:
        return None
    return _describe(chain, ranges, stages, bounds, parts, microbatches,
                     schedule, virtual, shared_slowdown)


def _fastest_bounds(times: list[np.ndarray], microbatches: int, virtual: int):
    """The chunk bounds of least ``schedule_step_s`` over the chunk time
    matrices ``times`` (inf: the range does not fit), None where none fits."""
    caps = np.unique(np.concatenate([t[np.isfinite(t)] for t in times]))
    if caps.size == 0:
        return None
    floor, free = _least_sum(times, np.inf)
    if free is None:
        return None
    if microbatches * virtual == 1:  # no max term: the least sum is the optimum
        return free
    # The least feasible cap, by bisection over the sorted stage times.
    lo, hi = 0, caps.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(_least_sum(times, caps[mid])[0]):
            hi = mid
        else:
            lo = mid + 1
    best_s, best_bounds = np.inf, None
    for cap in caps[lo:lo + MAX_CAPS]:
        # The split is chosen on the dedicated-device latency even where ranks
        # share their compute: the shared latency is flat in the stages'
        # balance where the work term binds (it sees sum(t) alone), so it
        # would pick any split of least sum, however unbalanced (measured
        # against balanced ones on 4 gloo ranks: within noise). The reported
        # step is the shared one.
        if schedule_step_s(floor, cap, microbatches, virtual) >= best_s:
            break  # the least sum with any larger cap is no better
        total, bounds = _least_sum(times, cap)
        if bounds is None:
            continue
        worst = max(times[k][a, b] for k, (a, b) in enumerate(bounds))
        latency = schedule_step_s(total, worst, microbatches, virtual)
        if latency < best_s:
            best_s, best_bounds = latency, bounds
    return best_bounds


@dataclass
class MixedSplit:
    """Chunk bounds where chunk ``j`` runs the plan of ``chains[plan_of[j]]``
    (``best_mixed_split``), recomputing where ``recompute[j]``; ``step_s``
    as the DP priced it (no conversion between the plans at the cuts)."""

    bounds: list[tuple[int, int]]
    plan_of: list[int]
    recompute: list[bool]
    step_s: float


def best_mixed_split(chains: list[Chain], stages: StageMeshes, microbatches: int,
                     schedule: str, budget, optimizer="adamw", recompute: bool = True,
                     virtual: int = 1) -> MixedSplit | None:
    """``best_partition`` where each chunk may run any of the submesh plans
    whose chains are ``chains`` (one traced graph, one submesh, the same
    units): per chunk and unit range, the fastest chain that fits. None where
    the chains' units differ, or no split fits."""
    if len({tuple((u.first, u.last, u.repeat) for u in c.units) for c in chains}) != 1:
        return None
    ranges = [_Ranges(c) for c in chains]
    chunks = stages.count * virtual
    if ranges[0].K < chunks:
        return None
    splits = _memory_splits(chains[0], ranges[0], stages, microbatches, schedule, optimizer,
                            virtual) if budget is not None else [(None, None)]
    best = None
    for holdings, reserve in splits:
        built = [_stage_matrices(c, r, stages, microbatches, schedule, budget, optimizer,
                                 recompute, virtual, holdings, reserve)
                 for c, r in zip(chains, ranges)]
        times, which = [], []
        for k in range(chunks):
            stack = np.stack([b[0][k] for b in built])
            pick = np.argmin(stack, axis=0)
            times.append(np.take_along_axis(stack, pick[None], 0)[0])
            which.append(pick)
        bounds = _fastest_bounds(times, microbatches, virtual)
        if bounds is None:
            continue
        t = [float(times[k][a, b]) for k, (a, b) in enumerate(bounds)]
        step = schedule_step_s(sum(t), max(t), microbatches, virtual)
        if best is None or step < best.step_s:
            plan_of = [int(which[k][a, b]) for k, (a, b) in enumerate(bounds)]
            best = MixedSplit(list(bounds), plan_of,
                              [bool(built[i][1][k].recomputes[a, b])
                               for k, (i, (a, b)) in enumerate(zip(plan_of, bounds))], step)
    return best


def bounds_partition(chain: Chain, stages: StageMeshes, bounds, recompute: list[bool],
                     microbatches: int, schedule: str, optimizer="adamw", virtual: int = 1,
                     shared_slowdown: float = 1.0) -> Partition:
    """The ``Partition`` of given chunk bounds and recomputation on ``chain``,
    with its modelled rank peaks (``rank_peaks``)."""
    ranges = _Ranges(chain)
    _, parts = _stage_matrices(chain, ranges, stages, microbatches, schedule, None,
                                  optimizer, True, virtual)
    chosen = [part.at(a, b, lean) for part, (a, b), lean in zip(parts, bounds, recompute)]
    return price_bounds(chain, stages, bounds, list(recompute), microbatches, schedule, ranges,
                        rank_peaks(chosen, stages.count), shared_slowdown, virtual)


def rank_peaks(parts: list[tuple[list[float], list[float], float, float]], n: int
               ) -> list[float]:
    """Per rank, its peak from its chunks' ``(bases, moments, step base, step
    temporary)`` bytes (chunk ``j`` on rank ``j mod n``; ``bases`` and
    ``moments`` one per holding the schedule reaches): at each holding every
    chunk's base while one chunk runs, its moment the largest; or, in the
    optimizer step, every chunk's state and the largest temporary."""
    peaks = []
    for r in range(n):
        mine = parts[r::n]
        held = max(sum(p[0][h] for p in mine) + max(p[1][h] for p in mine)
                   for h in range(len(mine[0][0])))
        peaks.append(max(held, sum(p[2] for p in mine) + max(p[3] for p in mine)))
    return peaks


def _memory_splits(chain: Chain, ranges: _Ranges, stages: StageMeshes, microbatches: int,
                   schedule: str, optimizer, virtual: int):
    """The ``(holdings, reserve)`` pairs the DP tries (``_stage_matrices``): per
    set of ``holding_sets``, no reserve and, interleaved, a reserve of the
    chain's largest transient with the largest output gradient a running
    chunk receives (what every split's largest moment fits); interleaved,
    each set also with each set of shares ``_split_shares`` makes of the
    fastest split without a budget (``_free_split``)."""
    n = stages.count
    sets = holding_sets(ranges, schedule, microbatches, n, virtual)
    if virtual == 1:
        return [(holdings, None) for holdings in sets]
    free = _free_split(chain, ranges, stages, microbatches, schedule, optimizer, virtual)
    k = ranges.K
    reserve = float(max(ranges.transient[0, k], ranges.accumulating[0, k])) \
        + ranges.out_grad_max
    return [(holdings, r) for r in (None, reserve)
            for holdings in sets + [[Holding(h.flight, h.done, list(shares), h.running)
                                     for h in held]
                                    for shares in _split_shares(free, n, virtual, r)
                                    for held in sets]]


def _free_split(chain: Chain, ranges: _Ranges, stages: StageMeshes, microbatches: int,
                schedule: str, optimizer, virtual: int):
    """The fastest interleaved split without a budget, as (its chunks'
    ``ChunkMemory``, its bounds), for ``_split_shares``; None if none."""
    free = _best_within(chain, ranges, stages, microbatches, schedule, None, optimizer, False,
                        virtual, 1.0, None, None)
    if free is None:
        return None
    _, parts = _stage_matrices(chain, ranges, stages, microbatches, schedule, None, optimizer,
                               True, virtual)
    return parts, free.bounds


def _split_shares(free, n: int, virtual: int, reserve: float | None) -> list[list[float]]:
    """Sets of per-chunk shares of its rank's budget in proportion to what the chunks
    of ``free`` (``_free_split``) hold at their most (their moment above
    ``reserve``), one set per choice of which of a rank's chunk positions recompute
    (the first few). The shares of ``holding_sets`` come from an even cut, and a
    split whose chunks differ (the trust GPT-2's last chunk holds the LM head and its
    logits) can fit its ranks' budgets within none of them: at 40 MiB no split was
    found where one of 37.4 MiB modelled, 17 % faster than the one found at 44 MiB,
    fits."""
    if free is None:
        return []
    parts, bounds = free
    out = []
    # A rank's earlier chunks keep more microbatches in flight: they are the
    # ones to recompute first (``virtual + 1`` patterns, not ``2 ** virtual``:
    # GPT-3 175B on 4 x 8, 4 chunks per rank, planned in 29.8 s with all).
    for lean in range(virtual + 1):
        pattern = [p < lean for p in range(virtual)]
        demand = []
        for j, (part, (a, b)) in enumerate(zip(parts, bounds)):
            bases, moments, _, _ = part.at(a, b, pattern[j // n])
            demand.append(max(base + max(moment - (reserve or 0.0), 0.0)
                              for base, moment in zip(bases, moments)))
        rank = [sum(demand[r::n]) for r in range(n)]
        if min(rank) > 0:
            out.append([d / rank[j % n] for j, d in enumerate(demand)])
    return out


def _describe(chain: Chain, ranges: _Ranges, stages: StageMeshes, bounds, parts,
              microbatches: int, schedule: str, virtual: int,
              shared_slowdown: float) -> Partition:
    recompute = [bool(part.recomputes[a, b]) for part, (a, b) in zip(parts, bounds)]
    chosen = [part.at(a, b) for part, (a, b) in zip(parts, bounds)]
    return price_bounds(chain, stages, bounds, recompute, microbatches, schedule, ranges,
                        rank_peaks(chosen, stages.count), shared_slowdown, virtual)


def price_bounds(chain: Chain, stages: StageMeshes, bounds, recompute: list[bool],
                 microbatches: int, schedule: str, ranges: _Ranges | None = None,
                 rank_peak_bytes: list[float] | None = None,
                 shared_slowdown: float = 1.0, virtual: int = 1) -> Partition:
    """The ``Partition`` of the chunks ``bounds`` (per chunk, units ``[a, b)``;
    chunk ``j`` on submesh ``j mod n``), ``recompute`` saying which recompute
    their forward; ``rank_peak_bytes`` per rank as given (``rank_peaks``;
    zeros when None), each chunk's its rank's."""
    ranges = ranges or _Ranges(chain)
    units = chain.units
    n = stages.count
    chunks = len(bounds)
    forward, backward = [], []
    send = [stages.send_s(k % n, (k + 1) % n, units[b - 1].out_bytes) for k, (_, b) in
            enumerate(bounds[:-1])]
    for k, (a, b) in enumerate(bounds):
        back = stages.send_s(k % n, (k - 1) % n, units[a - 1].out_grad_bytes) if k > 0 else 0.0
        again = float(ranges.compute[0][a, b]) if recompute[k] else 0.0
        forward.append(float(ranges.compute[0][a, b]) + (send[k] if k < chunks - 1 else 0.0))
        backward.append(float(ranges.compute[1][a, b]) + back + again)
    t = [f + b for f, b in zip(forward, backward)]
    # Per rank: its chunks' gradient syncs add up (each chunk is its own
    # module). A rank syncs when its schedule ends, after its last backward
    # (its lowest chunk's, chunk r's): chunks r - 1 .. 0 still run theirs (the
    # drain; where ranks share compute, one at a time, so up to the slowdown
    # faster), and only what outlasts that adds to the step. The optimizer
    # steps after the module's call, which ends on every rank together (the
    # loss's broadcast).
    tail = max(max(0.0, sum(stage_sync_s(chain, stages, a, b) for a, b in bounds[r::n])
                   - sum(backward[:r]) / max(shared_slowdown, 1.0))
               for r in range(n)) \
        + max(sum(u.optimizer_s for a, b in bounds[r::n] for u in units[a:b])
              for r in range(n))
    rank_peak = rank_peak_bytes or [0.0] * n
    tied = _tied_s(chain, ranges, stages, bounds)
    step = schedule_step_s(sum(t), max(t), microbatches, virtual, shared_slowdown, n) \
        + tail + tied
    return Partition(list(bounds), forward, backward,
                     [rank_peak[j % n] for j in range(chunks)],
                     send, tail, tied, step, list(recompute), virtual)


def stage_sync_s(chain: Chain, stages: StageMeshes, a: int, b: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """The all-reduce of the deferred gradients of the stage of units
    ``[a, b)``, packed as ``GradientSync`` packs them (buckets of
    ``bucket_bytes`` per set of mesh axes, each gradient once), so the
    latency is paid per bucket, not per parameter."""
    units = chain.units[a:b]
    grads: dict = {}
    for unit in units:
        grads.update(unit.sync)
    per_axes: dict = {}
    for axes, nbytes in grads.values():
        per_axes[axes] = per_axes.get(axes, 0.0) + nbytes
    mesh = stages.submesh
    sync = 0.0
    for axes, total in per_axes.items():
        full, rest = divmod(total, bucket_bytes)
        sync += full * mesh.all_reduce_cost_s(bucket_bytes, axes)
        sync += mesh.all_reduce_cost_s(rest, axes) if rest > 0 else 0.0
    return sync


def _tied_s(chain: Chain, ranges: _Ranges, stages: StageMeshes, bounds) -> float:
    """The all-reduce of each trainable weight held by several stages (a ring
    over its holders, on the slowest link between them)."""
    stage_of = {}  # unit -> submesh (a weight in two chunks of one rank: summed locally)
    for k, (a, b) in enumerate(bounds):
        for i in range(a, b):
            stage_of[i] = k % stages.count
    total = 0.0
    for key, where, _ in ranges.shared:
        grad = chain.grads.get(key, 0.0)
        holders = sorted({stage_of[i] for i in where})
        if grad <= 0 or len(holders) < 2:
            continue
        p = len(holders)
        alpha, bandwidth = stages.link_between(holders[0], holders[-1])
        total += 2 * (p - 1) * (alpha + grad / p / bandwidth)
    return total
