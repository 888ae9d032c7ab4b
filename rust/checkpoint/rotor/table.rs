//! The dynamic-programming table of Theorem 5.1 and the recovery of the
//! optimal schedule from it.
//!
//! `C(s, t, m)` is the least time to run sub-chain `(s, t)` — from its input
//! `a_s` (held outside) and `δ_{t+1}` to `δ_s` — within `m` slots, counting
//! `δ_{t+1}` and everything the sub-chain creates but not `a_s`:
//!
//! ```text
//! C(s, t, m) = min( C_all, min_{j = s+1..=t} C_ck(j), min_j C_free(j) )
//! C_all      = fwd_s + bwd_s + C(s+1, t, m - ā_s)          [C(s+1, s, ·) = 0]
//!              if m >= max(δ_{t+1} + ā_s + o_f,  ā_s + δ_{s+1} + δ_s + o_b)
//! C_ck(j)    = Σ_{k=s}^{j-1} fwd_k + C(j, t, m - a_j) + C(s, j-1, m)
//!              if m >= δ_{t+1} + max(a_{s+1} + o_f^s, max_{s<k<j} a_k + a_{k+1} + o_f^k)
//! C_free(j)  = Σ_{k=s}^{j-1} fwd_k + fwd_j + bwd_j + C(j+1, t, m - ā_j) + C(s, j-1, m)
//!              for a stage j that frees its input, if m >= the sweep's and
//!              m >= max(a_j + δ_{t+1} + ā_j + o_f^j, ā_j + δ_{j+1} + δ_j + o_b^j)
//! ```
//!
//! (fwd = u_f + u_fcomm, bwd = u_b + u_bcomm, o_f and o_b include the
//! communication buffers; ā_s is the saved set of stage s.) `C_free(j)` is
//! `C_ck(j)` with `(j, t)` saving stage j first, where that forward lets go
//! of the sweep's output `a_j` (`Stage::frees_input`): the same ops, without
//! `a_j` from then on. The forward sweep
//! of `C_ck(j)` is checked for its own `j`, not only for `j = t` as in the
//! paper's `m_∅`, and the `C_all` backward for its own temporaries, which the
//! paper's `m_all` misses.
//!
//! # Layout
//!
//! Cells are the `L (L+1) / 2` sub-chains, by length then start (see
//! `Cells`). Row `(s, t)` stores `C(s, t, m)` for `m` from the least feasible
//! memory `lo(s, t)` (from `min_memory`, so no row holds an infinity) to the
//! top budget, as `f32`. Choices are not stored: recovery recomputes the few
//! cells it visits with bit-identical arithmetic, so the table is 4 bytes a
//! cell instead of the 12 (f64 + int) of a dense `L x L x M` table.
//!
//! `f32` keeps 24 bits of mantissa: the values are sums of at most a few
//! `L^2` non-negative terms, so their relative error stays below ~1e-5 for
//! the chain lengths the solver can afford — far below the accuracy of the
//! profiled times. Near-ties may be broken either way; the reported time is
//! recomputed in f64 by replaying the schedule.
//!
//! # Work, memory traffic and parallelism
//!
//! Each `C_ck(j)` term is a whole row operation over `m` (two shifted rows
//! added to a constant, min-ed into the output): contiguous, branch-free and
//! vectorised (AVX when the CPU has it, chosen at run time), and cut to the
//! prefix of `m` where it can still beat the row (an exact f32 bound).
//!
//! The fill is bound by memory traffic, not arithmetic: cell (s, t) reads
//! `2 (t - s)` operand rows, `~L^3 / 3` rows in all (20 GB at L=400, M=500).
//! The default fill goes by blocks of starts (see `fill_by_rows`) so that
//! operand rows are read from cache, not memory: 1.6 s against 5.4 s for the
//! by-length fill on 2 threads at L=400/M=500 (interleaved A/B on a shared
//! 2-core machine, `tests::time_fill_orders`). The by-length fill, with the
//! cells of one length split over threads (`std::thread::scope`), is kept for
//! `solve_with_threads(.., threads > 1)`, where many cores with their own
//! memory bandwidth may repay it.

use super::schedule::{CheckpointBlock, Op};
use super::sizes::{Cells, Sizes};

/// Least work (inner-loop element updates) of one cell length before it is
/// split over threads: a spawn costs some tens of microseconds, this much
/// work some hundreds.
/// Starts filled together by the sequential fill: their rows (up to L cells
/// of up to M floats each) must stay in the last-level cache together.
const ROW_BLOCK: usize = 16;

/// Inner-loop element updates, counted in test builds.
#[cfg(test)]
pub(crate) static WORK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(crate) const PAR_MIN_WORK: usize = 1 << 20;

pub(crate) struct Table {
    cells: Cells,
    sz: Sizes,
    /// Top memory in slots (the budget minus the chain input).
    mmax: usize,
    lo: Vec<usize>,
    row_start: Vec<usize>,
    values: Vec<f32>,
    /// Per stage: forward seconds (f64, summed in f64 then rounded to f32).
    fwd_s: Vec<f64>,
    /// Per stage: (forward + backward seconds) as f32.
    fb_s: Vec<f32>,
}

/// The option a cell takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// `ForwardSaveAll(s)`, then `(s+1, t)`, then `Backward(s)`.
    SaveAll,
    /// Checkpoint `a_s`, sweep to `a_j`, `(j, t)`, then `(s, j-1)`.
    Checkpoint(usize),
    /// As `Checkpoint(j)` with `(j, t)` run as `ForwardSaveAll(j)` freeing
    /// `a_j`, `(j+1, t)`, `Backward(j)`: the same ops, less memory.
    CheckpointFreeing(usize),
}

impl Table {
    /// Fill the table for sizes in slots, with `mmax` slots at the top;
    /// `min_mem` is `min_memory` of the same sizes.
    pub fn build(
        sz: Sizes,
        min_mem: &[u64],
        fwd_s: Vec<f64>,
        bwd_s: &[f64],
        mmax: usize,
        threads: usize,
        par_min_work: usize,
    ) -> Table {
        let l = sz.len();
        let cells = Cells::new(l);
        let lo: Vec<usize> = min_mem
            .iter()
            .map(|&v| v.min(usize::MAX as u64 / 2) as usize)
            .collect();
        let mut row_start = Vec::with_capacity(cells.count() + 1);
        let mut acc = 0usize;
        for &lo_c in &lo {
            row_start.push(acc);
            acc += (mmax + 1).saturating_sub(lo_c);
        }
        row_start.push(acc);
        let fb_s = fwd_s
            .iter()
            .zip(bwd_s)
            .map(|(f, b)| (f + b) as f32)
            .collect();
        let mut table = Table {
            cells,
            sz,
            mmax,
            lo,
            row_start,
            // Zeroed pages come lazily from the OS; `fill_cell` writes every
            // entry of its row.
            values: vec![0.0; acc],
            fwd_s,
            fb_s,
        };
        table.fill(threads.max(1), par_min_work);
        table
    }

    fn fill(&mut self, threads: usize, par_min_work: usize) {
        let avx = has_avx();
        let mut values = std::mem::take(&mut self.values);
        let total_work = values.len() * self.sz.len() / 3;
        if threads == 1 || total_work < par_min_work {
            self.fill_by_rows(&mut values, avx);
            self.values = values;
            return;
        }
        let this = &*self;
        for d in 0..this.sz.len() {
            let range = this.cells.diagonal(d);
            let (first, end) = (range.start, range.end);
            let base = this.row_start[first];
            let (done, rest) = values.split_at_mut(base);
            let cur = &mut rest[..this.row_start[end] - base];
            let work = (this.row_start[end] - base) * (d + 1);
            let n = if work >= par_min_work { threads } else { 1 };
            if n == 1 {
                this.fill_cells(d, first, end, cur, done, avx);
                continue;
            }
            // Split the cells into n runs of about equal row length.
            let per = cur.len().div_ceil(n);
            let done = &*done;
            std::thread::scope(|scope| {
                let mut cur = cur;
                let mut c = first;
                while c < end {
                    let mut e = c + 1;
                    while e < end && this.row_start[e] - this.row_start[c] < per {
                        e += 1;
                    }
                    let (mine, others) = cur.split_at_mut(this.row_start[e] - this.row_start[c]);
                    cur = others;
                    let (cc, ee) = (c, e);
                    scope.spawn(move || this.fill_cells(d, cc, ee, mine, done, avx));
                    c = e;
                }
            });
        }
        self.values = values;
    }

    /// Sequential fill in blocks of `ROW_BLOCK` starts (descending), each
    /// block swept by end `t` ascending, then start descending. Cell (s, t)
    /// reads its row's earlier cells (s, j-1), which stay in cache, and the
    /// column cells (j, t), which the block's other starts read right after:
    /// each column row comes from memory once per block, not once per start
    /// (by length, every operand row would come from memory every time).
    fn fill_by_rows(&self, values: &mut [f32], avx: bool) {
        let l = self.sz.len();
        let mut hi = l;
        while hi > 0 {
            let lo_s = hi.saturating_sub(ROW_BLOCK);
            for t in lo_s..l {
                for s in (lo_s..hi.min(t + 1)).rev() {
                    // Every operand of (s, t) is shorter, so it lies before.
                    let c = self.cells.index(s, t);
                    let (done, rest) = values.split_at_mut(self.row_start[c]);
                    let row = &mut rest[..self.row_start[c + 1] - self.row_start[c]];
                    self.fill_cell(s, t, row, done, avx);
                }
            }
            hi = lo_s;
        }
    }

    /// Fill cells `first..end` (of one length) into `out`, their rows laid
    /// end to end; shorter cells are read from `done`.
    fn fill_cells(
        &self,
        d: usize,
        first: usize,
        end: usize,
        out: &mut [f32],
        done: &[f32],
        avx: bool,
    ) {
        let base = self.row_start[first];
        let diag_start = self.cells.diagonal(d).start;
        for c in first..end {
            let row = &mut out[self.row_start[c] - base..self.row_start[c + 1] - base];
            let s = c - diag_start;
            self.fill_cell(s, s + d, row, done, avx);
        }
    }

    fn row(&self, c: usize) -> &[f32] {
        &self.values[self.row_start[c]..self.row_start[c + 1]]
    }

    fn fill_cell(&self, s: usize, t: usize, row: &mut [f32], done: &[f32], avx: bool) {
        if row.is_empty() {
            return;
        }
        let sz = &self.sz;
        let mmax = self.mmax;
        let lo = self.lo[self.cells.index(s, t)];
        let rd = |c: usize| &done[self.row_start[c]..self.row_start[c + 1]];
        row.fill(f32::INFINITY);

        // Save all of stage s.
        let thr = self.save_all_threshold(s, t);
        if thr <= mmax {
            let out = &mut row[thr - lo..];
            let fb = self.fb_s[s];
            if s == t {
                out.fill(fb);
            } else {
                let sub = self.cells.index(s + 1, t);
                let src = &rd(sub)[thr - sz.saved[s] as usize - self.lo[sub]..];
                for (o, &x) in out.iter_mut().zip(src) {
                    *o = fb + x;
                }
            }
        }

        // Checkpoint a_s and sweep to a_j.
        let mut fwd = 0.0f64;
        let mut sweep = 0u64;
        for j in s + 1..=t {
            fwd += self.fwd_s[j - 1];
            sweep = sweep.max(sz.sweep_fwd_req(s, j - 1, t));
            if sweep > mmax as u64 {
                break;
            }
            let (right, left) = (self.cells.index(j, t), self.cells.index(s, j - 1));
            let lrow = rd(left);
            let aj = sz.act[j] as usize;
            let m0 = (sweep as usize).max(self.lo[right] + aj).max(self.lo[left]);
            if m0 <= mmax {
                // Rows are non-increasing in m, so this option costs at least
                // fwd + the last (largest-m) values of both rows, in the same
                // f32 arithmetic: it can only improve the prefix of the range
                // where the output row (also non-increasing) is still above that.
                let rrow = rd(right);
                let bound = fwd as f32 + rrow[rrow.len() - 1] + lrow[lrow.len() - 1];
                let n = row[m0 - lo..].partition_point(|&v| v > bound);
                if n > 0 {
                    #[cfg(test)]
                    WORK.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                    let out = &mut row[m0 - lo..][..n];
                    let r = &rrow[m0 - aj - self.lo[right]..][..n];
                    let l = &lrow[m0 - self.lo[left]..][..n];
                    relax(out, r, l, fwd as f32, avx);
                }
            }
            if !sz.frees_input[j] {
                continue;
            }
            // The same sweep, then stage j saves what it needs and frees a_j.
            let m0 = (sweep as usize)
                .max(self.freeing_threshold(j, t))
                .max(self.lo[left]);
            if m0 > mmax {
                continue;
            }
            let c = fwd as f32 + self.fb_s[j];
            let l = &lrow[m0 - self.lo[left]..];
            if j == t {
                let n = row[m0 - lo..].partition_point(|&v| v > c + lrow[lrow.len() - 1]);
                relax_const(&mut row[m0 - lo..][..n], &l[..n], c);
                continue;
            }
            let sub = self.cells.index(j + 1, t);
            let srow = rd(sub);
            let bound = c + srow[srow.len() - 1] + lrow[lrow.len() - 1];
            let n = row[m0 - lo..].partition_point(|&v| v > bound);
            if n == 0 {
                continue;
            }
            let r = &srow[m0 - sz.saved[j] as usize - self.lo[sub]..][..n];
            relax(&mut row[m0 - lo..][..n], r, &l[..n], c, avx);
        }
    }

    /// Least `m` at which sub-chain `(j, t)` may run as a saving forward of j
    /// that frees its plain input `a_j` (counted in `m`), then `(j+1, t)`, then
    /// `Backward(j)`.
    fn freeing_threshold(&self, j: usize, t: usize) -> usize {
        let rest = if j < t {
            self.lo[self.cells.index(j + 1, t)] as u64
        } else {
            0
        };
        self.sz.freeing_save_all_req(j, t, rest) as usize
    }

    /// Least `m` at which the save-all option of (s, t) is feasible.
    fn save_all_threshold(&self, s: usize, t: usize) -> usize {
        let sz = &self.sz;
        let mut thr = sz.save_all_req(s, t).max(sz.bwd_req(s)) as usize;
        if s < t {
            thr = thr.max(sz.saved[s] as usize + self.lo[self.cells.index(s + 1, t)]);
        }
        thr
    }

    /// `C(s, t, m)`, infinite when infeasible.
    pub fn value(&self, s: usize, t: usize, m: usize) -> f32 {
        let c = self.cells.index(s, t);
        if m < self.lo[c] || m > self.mmax {
            return f32::INFINITY;
        }
        self.row(c)[m - self.lo[c]]
    }

    /// The least `m <= mmax` with `C(0, L-1, m) == C(0, L-1, mmax)`: the
    /// optimal time with the least memory (rows are non-increasing in m).
    pub fn least_memory_for_best(&self) -> Option<usize> {
        let l = self.sz.len();
        let c = self.cells.index(0, l - 1);
        let row = self.row(c);
        let best = *row.last()?;
        let k = row.iter().position(|&v| v == best)?;
        Some(self.lo[c] + k)
    }

    /// Recompute the choice of cell (s, t) at m: the first option whose value
    /// (same arithmetic as `fill_cell`) equals the table's.
    fn choice(&self, s: usize, t: usize, m: usize) -> Choice {
        let sz = &self.sz;
        let target = self.value(s, t, m);
        debug_assert!(target.is_finite());
        if self.save_all_threshold(s, t) <= m {
            let v = if s == t {
                self.fb_s[s]
            } else {
                self.fb_s[s] + self.value(s + 1, t, m - sz.saved[s] as usize)
            };
            if v == target {
                return Choice::SaveAll;
            }
        }
        let mut fwd = 0.0f64;
        let mut sweep = 0u64;
        let mut best = (f32::INFINITY, Choice::Checkpoint(s + 1));
        for j in s + 1..=t {
            fwd += self.fwd_s[j - 1];
            sweep = sweep.max(sz.sweep_fwd_req(s, j - 1, t));
            if sweep > m as u64 {
                break;
            }
            let aj = sz.act[j] as usize;
            if m >= aj {
                let v = fwd as f32 + self.value(j, t, m - aj) + self.value(s, j - 1, m);
                if v == target {
                    return Choice::Checkpoint(j);
                }
                if v < best.0 {
                    best = (v, Choice::Checkpoint(j));
                }
            }
            if sz.frees_input[j] && m >= self.freeing_threshold(j, t) {
                let c = fwd as f32 + self.fb_s[j];
                let v = if j == t {
                    c + self.value(s, j - 1, m)
                } else {
                    c + self.value(j + 1, t, m - sz.saved[j] as usize) + self.value(s, j - 1, m)
                };
                if v == target {
                    return Choice::CheckpointFreeing(j);
                }
                if v < best.0 {
                    best = (v, Choice::CheckpointFreeing(j));
                }
            }
        }
        // Unreachable with bit-identical arithmetic; fall back to the best.
        debug_assert!(false, "no option reproduces C({s}, {t}, {m})");
        best.1
    }

    /// Emit the schedule of (s, t) at m into `out`, with `held` slots held
    /// outside the sub-chain (`a_s` included; `plain`: `a_s` is the output of
    /// a sweep, which a stage that frees its input lets go, as the replay
    /// does whichever option the table took); `blocks` receives this nesting
    /// level's blocks.
    pub fn recover(
        &self,
        (s, t, m): (usize, usize, usize),
        held: u64,
        plain: bool,
        out: &mut Recovered,
        blocks: &mut Vec<CheckpointBlock>,
    ) {
        let sz = &self.sz;
        let choice = self.choice(s, t, m);
        match choice {
            Choice::SaveAll => {
                out.ops.push(Op::ForwardSaveAll(s));
                out.claim(held + sz.save_all_req(s, t));
                let held = if plain && sz.frees_input[s] {
                    held - sz.act[s]
                } else {
                    held
                };
                if s < t {
                    let saved = sz.saved[s];
                    self.recover(
                        (s + 1, t, m - saved as usize),
                        held + saved,
                        false,
                        out,
                        blocks,
                    );
                }
                out.ops.push(Op::Backward(s));
                out.claim(held + sz.bwd_req(s));
            }
            Choice::Checkpoint(j) | Choice::CheckpointFreeing(j) => {
                out.ops.push(Op::ForwardCheckpoint(s));
                out.ops.extend((s + 1..j).map(Op::ForwardNoSave));
                for k in s..j {
                    out.claim(held + sz.sweep_fwd_req(s, k, t));
                }
                let aj = sz.act[j];
                let at = blocks.len();
                if matches!(choice, Choice::Checkpoint(_)) {
                    self.recover((j, t, m - aj as usize), held + aj, true, out, blocks);
                } else {
                    out.ops.push(Op::ForwardSaveAll(j));
                    out.claim(held + aj + sz.save_all_req(j, t));
                    if j < t {
                        let saved = sz.saved[j];
                        self.recover(
                            (j + 1, t, m - saved as usize),
                            held + saved,
                            false,
                            out,
                            blocks,
                        );
                    }
                    out.ops.push(Op::Backward(j));
                    out.claim(held + sz.bwd_req(j));
                }
                let mut children = Vec::new();
                self.recover((s, j - 1, m), held, false, out, &mut children);
                blocks.insert(
                    at,
                    CheckpointBlock {
                        start_stage: s,
                        end_stage: j - 1,
                        children,
                    },
                );
            }
        }
    }
}

/// The ops of a recovered schedule and the peak (in slots) that the
/// recurrence's memory conditions claim for it.
#[derive(Debug, Default)]
pub(crate) struct Recovered {
    pub ops: Vec<Op>,
    pub claimed_peak: u64,
}

impl Recovered {
    fn claim(&mut self, mem: u64) {
        self.claimed_peak = self.claimed_peak.max(mem);
    }
}

/// `out[i] = min(out[i], c + a[i] + b[i])`, the inner loop of the table.
#[inline(always)]
fn relax_generic(out: &mut [f32], a: &[f32], b: &[f32], c: f32) {
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        let v = c + x + y;
        *o = if v < *o { v } else { *o };
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn relax_avx(out: &mut [f32], a: &[f32], b: &[f32], c: f32) {
    relax_generic(out, a, b, c)
}

/// `out[i] = min(out[i], c + b[i])`: a sub-chain ending where the option's
/// saving stage is the last.
fn relax_const(out: &mut [f32], b: &[f32], c: f32) {
    for (o, &y) in out.iter_mut().zip(b) {
        let v = c + y;
        *o = if v < *o { v } else { *o };
    }
}

#[inline]
fn relax(out: &mut [f32], a: &[f32], b: &[f32], c: f32, avx: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx {
        // SAFETY: `avx` is true only when the CPU supports AVX (`has_avx`).
        unsafe { relax_avx(out, a, b, c) };
        return;
    }
    let _ = avx;
    relax_generic(out, a, b, c)
}

fn has_avx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
