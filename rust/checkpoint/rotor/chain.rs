//! The chain of stages the rotor solver schedules, and its errors.

use std::fmt;

/// One stage of a linearized network: the quantities of the MAP paper's
/// Table 1 (`u_f`, `u_b`, `o_f`, `o_b`, activation sizes) and Table 2
/// (`u_fcomm`, `u_bcomm`, `o_fcomm`, `o_bcomm`). Times in seconds, sizes in
/// bytes, all per device.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stage {
    /// `u_f`: compute time of one forward of the stage.
    pub fwd_compute_s: f64,
    /// `u_fcomm`: communication time of one forward (paid again on recomputation).
    pub fwd_comm_s: f64,
    /// `u_b`: compute time of the backward.
    pub bwd_compute_s: f64,
    /// `u_bcomm`: communication time of the backward.
    pub bwd_comm_s: f64,
    /// `o_f`: temporary bytes of a forward, beyond its inputs and outputs.
    pub fwd_tmp_bytes: u64,
    /// `o_fcomm`: communication buffers of a forward.
    pub fwd_comm_tmp_bytes: u64,
    /// Temporary bytes of a saving forward beyond its saved set, compute and
    /// communication together, where they differ from a forward that saves
    /// nothing (what the latter keeps transiently may be part of the saved
    /// set: a gathered weight); `None`: `fwd_overhead_bytes()`.
    pub save_fwd_tmp_bytes: Option<u64>,
    /// `o_b`: temporary bytes of the backward, beyond inputs and outputs.
    pub bwd_tmp_bytes: u64,
    /// `o_bcomm`: communication buffers of the backward.
    pub bwd_comm_tmp_bytes: u64,
    /// `ω_a`: the stage output `a_{k+1}`.
    pub out_bytes: u64,
    /// `ω_ā`: everything a saving forward keeps for the backward, the output
    /// included (so `saved_bytes >= out_bytes`).
    pub saved_bytes: u64,
    /// `ω_δ`: the gradient of the stage output, `δ_{k+1}`.
    pub out_grad_bytes: u64,
    /// Parameter gradients the backward of the stage creates: they stay live
    /// to the end (the optimizer step), whatever the schedule.
    pub param_grad_bytes: u64,
    /// Whether a saving forward of the stage lets go of a plain input `a_k`
    /// (the output of a checkpointed region before it, `k > 0`): nothing the
    /// stage keeps for its backward is that tensor as produced (it saves a
    /// converted copy, or only reads it), so the program frees it after its
    /// last reader and the backward does not need it. A checkpoint or a
    /// saved set `ā_k` is held to its own backward whatever this says.
    pub frees_input: bool,
}

impl Stage {
    /// Seconds of one forward, communication included.
    pub fn fwd_s(&self) -> f64 {
        self.fwd_compute_s + self.fwd_comm_s
    }
    /// Seconds of the backward, communication included.
    pub fn bwd_s(&self) -> f64 {
        self.bwd_compute_s + self.bwd_comm_s
    }
    /// Temporary bytes of a forward (compute and communication together).
    pub fn fwd_overhead_bytes(&self) -> u64 {
        self.fwd_tmp_bytes + self.fwd_comm_tmp_bytes
    }
    /// Temporary bytes of a saving forward beyond its saved set.
    pub fn save_fwd_overhead_bytes(&self) -> u64 {
        self.save_fwd_tmp_bytes
            .unwrap_or_else(|| self.fwd_overhead_bytes())
    }
    /// Temporary bytes of the backward (compute and communication together).
    pub fn bwd_overhead_bytes(&self) -> u64 {
        self.bwd_tmp_bytes + self.bwd_comm_tmp_bytes
    }
}

/// A validated chain: at least one stage, finite non-negative times,
/// `saved_bytes >= out_bytes`, and byte totals far from overflow.
#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    stages: Vec<Stage>,
    input_bytes: u64,
    input_grad_bytes: u64,
}

/// Largest total of all byte quantities of a chain (2^62): sums of live
/// tensors never overflow `u64`, nor `u128` products in slot rounding.
const MAX_TOTAL_BYTES: u128 = 1 << 62;

/// Largest (stages x total seconds of one forward and backward of every
/// stage): a schedule recomputes each forward at most once per stage, so its
/// time stays below this, far inside the f32 range of the solver's table
/// (3.4e38), where infinity means "does not fit".
const MAX_SCHEDULE_S: f64 = 1e30;

impl Chain {
    /// `input_bytes` is `a_0` (the chain input, held by the caller until the
    /// backward of stage 0); `input_grad_bytes` is `δ_0` (0 when the input
    /// needs no gradient). The terminal gradient `δ_L` is the last stage's
    /// `out_grad_bytes`.
    pub fn new(
        stages: Vec<Stage>,
        input_bytes: u64,
        input_grad_bytes: u64,
    ) -> Result<Chain, RotorError> {
        if stages.is_empty() {
            return Err(RotorError::InvalidChain("the chain has no stage".into()));
        }
        if stages.len() > u32::MAX as usize {
            return Err(RotorError::InvalidChain(format!(
                "the chain has {} stages; at most {} are supported",
                stages.len(),
                u32::MAX
            )));
        }
        let mut total = input_bytes as u128 + input_grad_bytes as u128;
        for (k, st) in stages.iter().enumerate() {
            for (name, v) in [
                ("fwd_compute_s", st.fwd_compute_s),
                ("fwd_comm_s", st.fwd_comm_s),
                ("bwd_compute_s", st.bwd_compute_s),
                ("bwd_comm_s", st.bwd_comm_s),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(RotorError::InvalidChain(format!(
                        "stage {k}: {name} must be finite and >= 0, got {v}"
                    )));
                }
            }
            if st.saved_bytes < st.out_bytes {
                return Err(RotorError::InvalidChain(format!(
                    "stage {k}: saved_bytes ({}) must include the output, out_bytes ({})",
                    st.saved_bytes, st.out_bytes
                )));
            }
            total += [
                st.fwd_tmp_bytes,
                st.fwd_comm_tmp_bytes,
                st.save_fwd_tmp_bytes.unwrap_or(0),
                st.bwd_tmp_bytes,
                st.bwd_comm_tmp_bytes,
                st.out_bytes,
                st.saved_bytes,
                st.out_grad_bytes,
                st.param_grad_bytes,
            ]
            .iter()
            .map(|&b| b as u128)
            .sum::<u128>();
        }
        let total_s: f64 = stages.iter().map(|s| s.fwd_s() + s.bwd_s()).sum();
        if total_s * stages.len() as f64 > MAX_SCHEDULE_S {
            return Err(RotorError::InvalidChain(format!(
                "the stage times add up to {total_s:e} s over {} stages; the solver needs \
                 stages x total <= {MAX_SCHEDULE_S:e} s",
                stages.len()
            )));
        }
        if total > MAX_TOTAL_BYTES {
            return Err(RotorError::InvalidChain(format!(
                "the byte quantities of the chain add up to {total}, more than 2^62"
            )));
        }
        Ok(Chain {
            stages,
            input_bytes,
            input_grad_bytes,
        })
    }

    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }
    /// The number of stages, `L`.
    pub fn len(&self) -> usize {
        self.stages.len()
    }
    /// Always false: a valid chain has at least one stage.
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }
    pub fn input_bytes(&self) -> u64 {
        self.input_bytes
    }
    pub fn input_grad_bytes(&self) -> u64 {
        self.input_grad_bytes
    }
    /// Seconds of one forward and one backward of every stage: the time of a
    /// schedule that recomputes nothing, a lower bound of every schedule.
    pub fn no_recompute_time_s(&self) -> f64 {
        self.stages.iter().map(|s| s.fwd_s() + s.bwd_s()).sum()
    }
}

/// Errors of the rotor solver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RotorError {
    /// A chain, a budget or a slot count that the solver cannot take.
    InvalidChain(String),
    /// An op sequence that is not a valid schedule of its chain.
    InvalidSchedule(String),
    /// No schedule fits the budget. `min_budget_bytes` is the smallest budget
    /// that does at the same slot count (the exact minimum over all
    /// schedules is `exact_min_budget_bytes`; slot rounding may need a little more).
    InfeasibleBudget {
        budget_bytes: u64,
        min_budget_bytes: u64,
        exact_min_budget_bytes: u64,
        slots: usize,
    },
}

impl fmt::Display for RotorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RotorError::InvalidChain(m) | RotorError::InvalidSchedule(m) => f.write_str(m),
            RotorError::InfeasibleBudget {
                budget_bytes,
                min_budget_bytes,
                exact_min_budget_bytes,
                slots,
            } => {
                write!(
                    f,
                    "infeasible: the activation-checkpoint schedule needs at least \
                     {min_budget_bytes} bytes, the budget is {budget_bytes} bytes"
                )?;
                if exact_min_budget_bytes != min_budget_bytes {
                    write!(
                        f,
                        " (the least memory of any schedule is {exact_min_budget_bytes} bytes; \
                         rounding sizes up to {slots} memory slots needs more: raise the slot \
                         count to get closer)"
                    )?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for RotorError {}
