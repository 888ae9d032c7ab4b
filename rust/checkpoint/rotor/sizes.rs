//! Chain sizes in one integer unit (bytes, or memory slots), the memory each
//! op of the dynamic program needs, the triangular cell index, and the
//! least-memory recurrence.

use super::chain::Chain;

/// Sizes of a chain of `L` stages in one unit. Index `k` of `act` and `grad`
/// is `a_k` / `δ_k` (`0..=L`); index `k` of the others is stage `k`.
///
/// Parameter gradients never leave once made, so they ride on the activation
/// gradient: `grad[k]` is `δ_k` plus the parameter gradients of stages `k..L`
/// (live whenever `δ_k` is), and `bwd_out[k]` what the backward of stage `k`
/// adds: `δ_k` and its own parameter gradients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sizes {
    pub act: Vec<u64>,
    pub grad: Vec<u64>,
    pub bwd_out: Vec<u64>,
    pub saved: Vec<u64>,
    pub fwd_tmp: Vec<u64>,
    pub save_fwd_tmp: Vec<u64>,
    pub bwd_tmp: Vec<u64>,
    /// Per stage: `Stage::frees_input`, and never for stage 0 (the chain
    /// input is the caller's).
    pub frees_input: Vec<bool>,
}

impl Sizes {
    /// Exact sizes in bytes.
    pub fn bytes(chain: &Chain) -> Sizes {
        Sizes::map(chain, |b| b)
    }

    /// Sizes in slots of `budget_bytes / slots` bytes, each rounded up:
    /// `ceil(x * slots / budget_bytes)`. Op temporaries are rounded once,
    /// compute and communication together.
    pub fn slots(chain: &Chain, budget_bytes: u64, slots: usize) -> Sizes {
        Sizes::map(chain, |b| to_slots(b, budget_bytes, slots))
    }

    pub fn map(chain: &Chain, f: impl Fn(u64) -> u64) -> Sizes {
        let st = chain.stages();
        let mut act = vec![f(chain.input_bytes())];
        act.extend(st.iter().map(|s| f(s.out_bytes)));
        // Parameter gradients of stages k.. (index k), and δ_k per index.
        let mut later = vec![0u64; st.len() + 1];
        for k in (0..st.len()).rev() {
            later[k] = later[k + 1] + st[k].param_grad_bytes;
        }
        let delta: Vec<u64> = std::iter::once(chain.input_grad_bytes())
            .chain(st.iter().map(|s| s.out_grad_bytes))
            .collect();
        let grad = (0..=st.len()).map(|k| f(delta[k] + later[k])).collect();
        let bwd_out = (0..st.len())
            .map(|k| f(delta[k] + st[k].param_grad_bytes))
            .collect();
        Sizes {
            act,
            grad,
            bwd_out,
            saved: st.iter().map(|s| f(s.saved_bytes)).collect(),
            fwd_tmp: st.iter().map(|s| f(s.fwd_overhead_bytes())).collect(),
            save_fwd_tmp: st.iter().map(|s| f(s.save_fwd_overhead_bytes())).collect(),
            bwd_tmp: st.iter().map(|s| f(s.bwd_overhead_bytes())).collect(),
            frees_input: st
                .iter()
                .enumerate()
                .map(|(k, s)| k > 0 && s.frees_input)
                .collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.saved.len()
    }

    // Memory an op needs inside sub-chain (s, t), counting neither the
    // sub-chain input a_s (held by the caller) nor anything held outside.
    // δ_{t+1} is live until the backward of stage t.

    /// The first forward of a checkpointing sweep (`ForwardCheckpoint(s)`,
    /// `k == s`) or a later `ForwardNoSave(k)` of the sweep, `s < k < t`.
    #[inline]
    pub fn sweep_fwd_req(&self, s: usize, k: usize, t: usize) -> u64 {
        if k == s {
            self.grad[t + 1] + self.act[s + 1] + self.fwd_tmp[s]
        } else {
            self.grad[t + 1] + self.act[k] + self.act[k + 1] + self.fwd_tmp[k]
        }
    }

    /// `ForwardSaveAll(s)` at the start of sub-chain (s, t).
    #[inline]
    pub fn save_all_req(&self, s: usize, t: usize) -> u64 {
        self.grad[t + 1] + self.saved[s] + self.save_fwd_tmp[s]
    }

    /// `Backward(s)`: `ā_{s+1}`, `δ_{s+1}` (with the parameter gradients so far),
    /// the new `δ_s` and parameter gradients, and temporaries.
    #[inline]
    pub fn bwd_req(&self, s: usize) -> u64 {
        self.saved[s] + self.grad[s + 1] + self.bwd_out[s] + self.bwd_tmp[s]
    }

    /// Least memory of sub-chain `(j, t)` run as `ForwardSaveAll(j)`, `(j+1,
    /// t)`, `Backward(j)` by a stage that `frees_input`, counting its plain
    /// input `a_j` (live through the forward, freed after it) but nothing
    /// held outside; `rest` is the least memory of `(j+1, t)` (0 when
    /// `j == t`).
    #[inline]
    pub fn freeing_save_all_req(&self, j: usize, t: usize, rest: u64) -> u64 {
        let sub = if j < t { self.saved[j] + rest } else { 0 };
        (self.act[j] + self.save_all_req(j, t))
            .max(self.bwd_req(j))
            .max(sub)
    }
}

/// `ceil(bytes * slots / budget_bytes)`, in u128 so that it cannot overflow.
pub(crate) fn to_slots(bytes: u64, budget_bytes: u64, slots: usize) -> u64 {
    let num = bytes as u128 * slots as u128;
    let den = budget_bytes as u128;
    num.div_ceil(den).min(u64::MAX as u128) as u64
}

/// Triangular index of the sub-chains `(s, t)`, `s <= t < L`, grouped by
/// length `d = t - s` (all cells of one length are contiguous, so they can be
/// filled in parallel from the shorter ones), then by `s`.
#[derive(Debug, Clone)]
pub(crate) struct Cells {
    len: usize,
    diag_start: Vec<usize>,
}

impl Cells {
    pub fn new(len: usize) -> Cells {
        let mut diag_start = Vec::with_capacity(len + 1);
        let mut acc = 0;
        for d in 0..=len {
            diag_start.push(acc);
            acc += len - d.min(len);
        }
        Cells { len, diag_start }
    }
    /// L (L + 1) / 2.
    pub fn count(&self) -> usize {
        self.diag_start[self.len]
    }
    #[inline]
    pub fn index(&self, s: usize, t: usize) -> usize {
        debug_assert!(s <= t && t < self.len);
        self.diag_start[t - s] + s
    }
    /// The cell range of the sub-chains of length `d + 1`.
    pub fn diagonal(&self, d: usize) -> std::ops::Range<usize> {
        self.diag_start[d]..self.diag_start[d + 1]
    }
}

/// The least memory of any schedule of every sub-chain (same recurrence as
/// the time table, with `max` for `+` and `min` for `min`): `mm[cell(s, t)]`
/// counts δ_{t+1} and everything but the input a_s. O(L^3) integer work.
pub(crate) fn min_memory(sz: &Sizes, cells: &Cells) -> Vec<u64> {
    let l = sz.len();
    let mut mm = vec![0u64; cells.count()];
    for d in 0..l {
        for s in 0..l - d {
            let t = s + d;
            // Save everything of stage s, process (s+1, t), backward s.
            let mut best = sz.save_all_req(s, t).max(sz.bwd_req(s));
            if d > 0 {
                best = best.max(sz.saved[s] + mm[cells.index(s + 1, t)]);
            }
            // Checkpoint a_s, sweep to a_j, process (j, t), then (s, j-1).
            let mut sweep = 0;
            for j in s + 1..=t {
                sweep = sweep.max(sz.sweep_fwd_req(s, j - 1, t));
                if sweep >= best {
                    break; // the sweep only grows with j
                }
                let left = mm[cells.index(s, j - 1)];
                let cand = sweep.max(sz.act[j] + mm[cells.index(j, t)]).max(left);
                best = best.min(cand);
                if sz.frees_input[j] {
                    // The sweep's output goes once stage j has saved what it needs.
                    let rest = if j < t { mm[cells.index(j + 1, t)] } else { 0 };
                    best = best.min(sweep.max(sz.freeing_save_all_req(j, t, rest)).max(left));
                }
            }
            mm[cells.index(s, t)] = best;
        }
    }
    mm
}
