//! Activation checkpointing: the rotor dynamic program of Herrmann et al.
//! ("Optimal checkpointing for heterogeneous chains"), extended with the
//! communication overheads of MAP (section 5.2.1, Tables 1 and 2, Theorem 5.1).
//!
//! # The model
//!
//! A [`Chain`] has `L` stages, numbered `0..L`. Stage `k` reads activation
//! `a_k` and writes `a_{k+1}`; `a_0` is the chain input, held by the caller.
//! `ā_{k+1}` is everything the backward of stage `k` needs (its output
//! included); `δ_k` is the gradient with respect to `a_k`. The operations are
//! those of the paper's Table 1 ([`Op`]):
//!
//! | op                      | needs              | leaves                       |
//! |-------------------------|--------------------|------------------------------|
//! | `ForwardNoSave(k)`  F∅  | `a_k`, not a checkpoint | `a_{k+1}` (`a_k` is freed) |
//! | `ForwardCheckpoint(k)` Fck | `a_k` or `ā_k`  | input kept (as a checkpoint), `a_{k+1}` |
//! | `ForwardSaveAll(k)` Fall| `a_k` or `ā_k`     | input kept, `ā_{k+1}`        |
//! | `Backward(k)`  B        | `δ_{k+1}, ā_{k+1}`, `a_k` or `ā_k` | `δ_k` (`a_k` is freed, `ā_k` kept) |
//!
//! A stage that `frees_input` needs no plain `a_k` (`k > 0`) once its
//! saving forward ran: `ForwardSaveAll(k)` frees it (the program drops the
//! output of a checkpointed region after its last reader when the next
//! stage keeps only a copy of it), and `Backward(k)` runs without it.
//!
//! A checkpoint (the input that a `ForwardCheckpoint` keeps) lives until the
//! backward of its stage, as the input that `torch.utils.checkpoint` saves
//! does: a forward may not consume it. A forward reads the last (highest)
//! live activation: recomputation is last in, first out, as nested
//! checkpoint regions recompute when the backward reaches them and not
//! before. (Without that rule a schedule may recompute part of a region
//! early, while a smaller gradient is live, and beat the dynamic program
//! when gradient and activation sizes differ: the tests found a 5-stage
//! chain needing 11 bytes against the program's 12. Such schedules have no
//! nested `torch.utils.checkpoint` form.)
//!
//! Every forward of stage `k` (first run or recomputation) costs
//! `u_f + u_fcomm` seconds and needs `o_f + o_fcomm` temporary bytes on top of
//! what is live; every backward costs `u_b + u_bcomm` and `o_b + o_bcomm`.
//! (The paper's equation 5 charges only `u_f` to the recomputed forwards of
//! `C_ck`; a recomputed forward re-runs its collectives, so we charge both.
//! The two temporaries are added, as in the paper's equation 6: a
//! conservative bound when compute and communication buffers overlap.)
//! The memory of an op is what is live before it, plus its outputs, plus its
//! temporaries; inputs it consumes are freed after it. The terminal gradient
//! `δ_L` is live from the start (the caller supplies it; for a chain ending in
//! the loss it is a scalar) and `a_0` is live until `Backward(0)`.
//!
//! No op discards `ā_{k+1}` or a checkpoint except the backward that
//! consumes it, so every schedule of this model runs `ForwardSaveAll(k)` at
//! most once and keeps its checkpoints to their backward: every schedule is
//! *persistent*. The dynamic program (Theorem 5.1, see `table.rs`) is
//! optimal over all of them; the tests check it against an exhaustive search
//! of the model's state space.
//!
//! # Memory slots
//!
//! The budget `B` bytes is cut into `M` slots of `B / M` bytes. A size of `x`
//! bytes takes `ceil(x * M / B)` slots, and the solver may use all `M` slots.
//! Rounding every size *up* (and each op's two temporaries together, once)
//! keeps the schedule feasible: any schedule whose peak fits `M` slots has a
//! peak of at most `M * B / M = B` bytes. The price is pessimism of less than
//! one slot per live tensor; the reported peak is replayed exactly in bytes.
//!
//! # Results
//!
//! [`solve`] returns a [`Schedule`]: the op sequence, the same schedule as
//! nested [`CheckpointBlock`]s (each a `torch.utils.checkpoint` region), its
//! predicted time and exact peak memory. A budget that is too small gives
//! [`RotorError::InfeasibleBudget`] with the smallest budget that fits.

mod chain;
mod example;
mod schedule;
mod sizes;
mod solve;
mod table;

#[cfg(test)]
mod tests;

pub use chain::{Chain, RotorError, Stage};
pub use example::example_chain;
pub use schedule::{ops_of_blocks, simulate, CheckpointBlock, Op, Replay};
pub use solve::{min_budget_bytes, solve, solve_with_threads, Schedule, DEFAULT_SLOTS};
