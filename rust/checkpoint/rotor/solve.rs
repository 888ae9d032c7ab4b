//! The solver entry points: discretise, fill the table, recover and replay.

use super::chain::{Chain, RotorError};
use super::schedule::{replay, CheckpointBlock, Op};
use super::sizes::{min_memory, Cells, Sizes};
use super::table::{Recovered, Table, PAR_MIN_WORK};

/// The slot count of the MAP paper's experiments and of the benches.
pub const DEFAULT_SLOTS: usize = 500;

/// Most slots a solve accepts (the table grows linearly with them).
const MAX_SLOTS: usize = 1 << 20;

/// The optimal persistent schedule of a chain under a memory budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// The operations in execution order.
    pub ops: Vec<Op>,
    /// The same schedule as nested `torch.utils.checkpoint` regions.
    pub blocks: Vec<CheckpointBlock>,
    /// Time of the schedule: every forward (recomputations included) and
    /// backward, communication included.
    pub predicted_time_s: f64,
    /// Exact peak memory of the schedule in bytes (activations, gradients,
    /// temporaries; chain input and terminal gradient included).
    pub peak_memory_bytes: u64,
    /// Time without any recomputation (the lower bound of every schedule).
    pub no_recompute_time_s: f64,
    pub budget_bytes: u64,
    pub slots: usize,
}

impl Schedule {
    /// Seconds spent recomputing forwards.
    pub fn recompute_time_s(&self) -> f64 {
        (self.predicted_time_s - self.no_recompute_time_s).max(0.0)
    }
}

/// The solution plus what the dynamic program claimed, for the tests.
#[derive(Debug)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct Solved {
    pub schedule: Schedule,
    /// `C(0, L-1, mmax)` from the table.
    pub table_time_s: f32,
    /// The peak in slots that the recurrence's memory conditions claim.
    pub claimed_peak_slots: u64,
    pub sizes_in_slots: Sizes,
}

/// The optimal schedule of `chain` within `budget_bytes`, memory cut into
/// `slots` slots (see the module docs; [`DEFAULT_SLOTS`] is a good default).
/// One thread: the cache-blocked sequential fill beats the parallel one on
/// the machines measured (see `table.rs`).
pub fn solve(chain: &Chain, budget_bytes: u64, slots: usize) -> Result<Schedule, RotorError> {
    solve_with_threads(chain, budget_bytes, slots, 1)
}

/// [`solve`] with the table filled by cell length on `threads` threads when
/// `threads > 1` and the table is large enough to repay the spawns.
pub fn solve_with_threads(
    chain: &Chain,
    budget_bytes: u64,
    slots: usize,
    threads: usize,
) -> Result<Schedule, RotorError> {
    solve_full(chain, budget_bytes, slots, threads, PAR_MIN_WORK).map(|s| s.schedule)
}

/// The least budget of any schedule of the chain, in bytes (no slot rounding).
pub fn min_budget_bytes(chain: &Chain) -> u64 {
    let sz = Sizes::bytes(chain);
    let cells = Cells::new(sz.len());
    sz.act[0] + min_memory(&sz, &cells)[cells.index(0, sz.len() - 1)]
}

/// Whether some schedule fits `budget_bytes` once sizes are in slots.
fn fits_in_slots(chain: &Chain, budget_bytes: u64, slots: usize) -> bool {
    let sz = Sizes::slots(chain, budget_bytes, slots);
    let cells = Cells::new(sz.len());
    sz.act[0] + min_memory(&sz, &cells)[cells.index(0, sz.len() - 1)] <= slots as u64
}

fn infeasible(chain: &Chain, budget_bytes: u64, slots: usize) -> RotorError {
    // With a huge budget every non-empty tensor takes one slot: if even that
    // does not fit, no budget does at this slot count.
    let ones = Sizes::map(chain, |b| u64::from(b > 0));
    let cells = Cells::new(ones.len());
    let min_slots = ones.act[0] + min_memory(&ones, &cells)[cells.index(0, ones.len() - 1)];
    if min_slots > slots as u64 {
        return RotorError::InvalidChain(format!(
            "{slots} memory slots cannot hold the {min_slots} tensors that the schedule needs \
             live at once; use at least {min_slots} slots"
        ));
    }
    let exact = min_budget_bytes(chain);
    // Fitting in slots is monotone in the budget (every rounded size shrinks
    // as the budget grows): grow a step until it fits, then bisect.
    let mut lo = exact.max(budget_bytes + 1) - 1; // does not fit
    let mut step = (exact / slots as u64).max(1);
    let mut hi = lo + step;
    while !fits_in_slots(chain, hi, slots) {
        lo = hi;
        step = step.saturating_mul(2);
        hi = hi.saturating_add(step);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits_in_slots(chain, mid, slots) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    RotorError::InfeasibleBudget {
        budget_bytes,
        min_budget_bytes: hi,
        exact_min_budget_bytes: exact,
        slots,
    }
}

pub(crate) fn solve_full(
    chain: &Chain,
    budget_bytes: u64,
    slots: usize,
    threads: usize,
    par_min_work: usize,
) -> Result<Solved, RotorError> {
    if budget_bytes == 0 {
        return Err(RotorError::InvalidChain("budget_bytes must be > 0".into()));
    }
    if slots == 0 || slots > MAX_SLOTS {
        return Err(RotorError::InvalidChain(format!(
            "slots must be in 1..={MAX_SLOTS}, got {slots}"
        )));
    }
    let l = chain.len();
    let sz = Sizes::slots(chain, budget_bytes, slots);
    let cells = Cells::new(l);
    let min_mem = min_memory(&sz, &cells);
    let a0 = sz.act[0];
    if a0 + min_mem[cells.index(0, l - 1)] > slots as u64 {
        return Err(infeasible(chain, budget_bytes, slots));
    }
    let mmax = slots - a0 as usize;
    let fwd_s: Vec<f64> = chain.stages().iter().map(|s| s.fwd_s()).collect();
    let bwd_s: Vec<f64> = chain.stages().iter().map(|s| s.bwd_s()).collect();
    let table = Table::build(
        sz.clone(),
        &min_mem,
        fwd_s.clone(),
        &bwd_s,
        mmax,
        threads,
        par_min_work,
    );
    let table_time_s = table.value(0, l - 1, mmax);
    // A feasible top cell has a finite value (chain times are capped so that
    // no schedule's time overflows the table's f32).
    let Some(m) = table.least_memory_for_best() else {
        return Err(RotorError::InvalidChain(
            "the checkpoint table has no finite entry for the whole chain".into(),
        ));
    };

    let mut rec = Recovered {
        ops: Vec::with_capacity(4 * l),
        claimed_peak: sz.act[0] + sz.grad[l],
    };
    let mut blocks = Vec::new();
    table.recover((0, l - 1, m), a0, false, &mut rec, &mut blocks);
    let Recovered {
        ops,
        claimed_peak: claimed_peak_slots,
    } = rec;

    let measured = replay(&Sizes::bytes(chain), &fwd_s, &bwd_s, &ops)?;
    debug_assert!(measured.peak_memory_bytes <= budget_bytes);
    Ok(Solved {
        schedule: Schedule {
            ops,
            blocks,
            predicted_time_s: measured.time_s,
            peak_memory_bytes: measured.peak_memory_bytes,
            no_recompute_time_s: chain.no_recompute_time_s(),
            budget_bytes,
            slots,
        },
        table_time_s,
        claimed_peak_slots,
        sizes_in_slots: sz,
    })
}
