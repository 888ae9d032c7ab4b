//! Schedules: the op sequence, its nested checkpoint blocks, and a replay
//! that executes an op sequence on the memory model and measures it.

use super::chain::{Chain, RotorError};
use super::sizes::Sizes;

/// One operation of a schedule (the MAP paper's Table 1); the number is the
/// stage. A forward of a stage that already ran is a recomputation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `F∅`: forward without saving; the input `a_k` is freed, `a_{k+1}` made.
    ForwardNoSave(usize),
    /// `Fck`: forward keeping the input as a checkpoint, saving nothing else.
    ForwardCheckpoint(usize),
    /// `Fall`: forward saving everything the backward needs (`ā_{k+1}`).
    ForwardSaveAll(usize),
    /// `B`: backward of the stage, from `δ_{k+1}` to `δ_k`.
    Backward(usize),
}

impl Op {
    pub fn stage(&self) -> usize {
        match *self {
            Op::ForwardNoSave(k)
            | Op::ForwardCheckpoint(k)
            | Op::ForwardSaveAll(k)
            | Op::Backward(k) => k,
        }
    }
    /// "forward_no_save", "forward_checkpoint", "forward_save_all" or "backward".
    pub fn name(&self) -> &'static str {
        match self {
            Op::ForwardNoSave(_) => "forward_no_save",
            Op::ForwardCheckpoint(_) => "forward_checkpoint",
            Op::ForwardSaveAll(_) => "forward_save_all",
            Op::Backward(_) => "backward",
        }
    }
    pub fn is_forward(&self) -> bool {
        !matches!(self, Op::Backward(_))
    }
}

/// A checkpointed region over stages `start_stage..=end_stage`: run as
/// `torch.utils.checkpoint.checkpoint(region, a_start, use_reentrant=False)`.
/// Its forward keeps only its input; its backward recomputes the region, in
/// which the `children` (sorted, disjoint, inside the region) are again
/// checkpointed and every other stage saves its activations. Stages outside
/// every top-level block run normally. See [`ops_of_blocks`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointBlock {
    pub start_stage: usize,
    pub end_stage: usize,
    pub children: Vec<CheckpointBlock>,
}

/// The op sequence that nested checkpoint regions execute, for a chain of
/// `len` stages with top-level `blocks`: the semantics of nested
/// `torch.utils.checkpoint`. `ops_of_blocks(L, &schedule.blocks) ==
/// schedule.ops` for every schedule [`solve`](super::solve) returns.
pub fn ops_of_blocks(len: usize, blocks: &[CheckpointBlock]) -> Vec<Op> {
    let mut ops = Vec::new();
    if len > 0 {
        expand(0, len - 1, blocks, &mut ops);
    }
    ops
}

fn expand(s: usize, t: usize, blocks: &[CheckpointBlock], ops: &mut Vec<Op>) {
    // Forward over the level: a block runs its stages without saving, keeping
    // its input; every other stage saves all.
    enum Item<'a> {
        Stage(usize),
        Block(&'a CheckpointBlock),
    }
    let mut items = Vec::new();
    let mut next = blocks.iter().peekable();
    let mut k = s;
    while k <= t {
        match next.peek() {
            Some(b) if b.start_stage == k => {
                ops.push(Op::ForwardCheckpoint(k));
                ops.extend((k + 1..=b.end_stage).map(Op::ForwardNoSave));
                k = b.end_stage + 1;
                items.push(Item::Block(b));
                next.next();
            }
            _ => {
                ops.push(Op::ForwardSaveAll(k));
                items.push(Item::Stage(k));
                k += 1;
            }
        }
    }
    // Backward in reverse: a block recomputes its region with its children.
    for item in items.iter().rev() {
        match item {
            Item::Stage(k) => ops.push(Op::Backward(*k)),
            Item::Block(b) => expand(b.start_stage, b.end_stage, &b.children, ops),
        }
    }
}

/// The measured replay of an op sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    /// Sum of the op times (forwards and backwards, communication included).
    pub time_s: f64,
    /// The largest memory during any op, chain input and δ_L included.
    pub peak_memory_bytes: u64,
    /// Per op: the memory while it runs (live + outputs + temporaries).
    pub op_memory_bytes: Vec<u64>,
    /// Per op: the memory once it finished and freed its consumed inputs.
    pub memory_after_bytes: Vec<u64>,
}

/// Replay `ops` on the memory model of the module docs: checks that every op
/// has its inputs and that the sequence ends with `δ_0`, and measures time
/// and memory exactly (in bytes).
pub fn simulate(chain: &Chain, ops: &[Op]) -> Result<Replay, RotorError> {
    let fwd: Vec<f64> = chain.stages().iter().map(|s| s.fwd_s()).collect();
    let bwd: Vec<f64> = chain.stages().iter().map(|s| s.bwd_s()).collect();
    replay(&Sizes::bytes(chain), &fwd, &bwd, ops)
}

pub(crate) fn replay(
    sz: &Sizes,
    fwd_s: &[f64],
    bwd_s: &[f64],
    ops: &[Op],
) -> Result<Replay, RotorError> {
    let mut state = State::new(sz);
    let mut out = Replay {
        time_s: 0.0,
        peak_memory_bytes: state.mem,
        op_memory_bytes: Vec::with_capacity(ops.len()),
        memory_after_bytes: Vec::with_capacity(ops.len()),
    };
    for (i, op) in ops.iter().enumerate() {
        let during = state
            .apply(sz, *op)
            .map_err(|e| RotorError::InvalidSchedule(format!("op {i} ({op:?}): {e}")))?;
        out.time_s += match op {
            Op::Backward(k) => bwd_s[*k],
            _ => fwd_s[op.stage()],
        };
        out.peak_memory_bytes = out.peak_memory_bytes.max(during);
        out.op_memory_bytes.push(during);
        out.memory_after_bytes.push(state.mem);
    }
    if state.backward_from != 0 {
        return Err(RotorError::InvalidSchedule(format!(
            "the schedule stops before the backward of stage {}",
            state.backward_from - 1
        )));
    }
    Ok(out)
}

/// What activation slot k holds: nothing, a plain `a_k`, `a_k` kept as a
/// checkpoint (the input of a `ForwardCheckpoint`), the saved set `ā_k`, or
/// nothing where a plain `a_k` was let go by a stage that `frees_input` (its
/// backward runs without it).
pub(crate) const NONE: u8 = 0;
pub(crate) const PLAIN: u8 = 1;
pub(crate) const CHECKPOINT: u8 = 2;
pub(crate) const SAVED: u8 = 3;
pub(crate) const FREED: u8 = 4;

/// The live tensors between two ops: what each activation slot holds; the
/// backward front (`δ_b` is live, stages `b..L` are done); the bytes (or
/// slots) live.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct State {
    pub act: Vec<u8>,
    pub backward_from: usize,
    pub mem: u64,
}

impl State {
    pub fn new(sz: &Sizes) -> State {
        let l = sz.len();
        let mut act = vec![NONE; l + 1];
        act[0] = PLAIN;
        State {
            act,
            backward_from: l,
            mem: sz.act[0] + sz.grad[l],
        }
    }

    /// Apply one op; returns the memory during it.
    pub fn apply(&mut self, sz: &Sizes, op: Op) -> Result<u64, String> {
        let k = op.stage();
        if k >= sz.len() {
            return Err(format!("no stage {k}"));
        }
        if op.is_forward() && k >= self.backward_from {
            return Err("forward of a stage whose backward is done".into());
        }
        if op.is_forward() && self.act[k + 1..].iter().any(|&x| x != NONE) {
            return Err(format!(
                "a_{k} is not the last live activation: recomputation is last in, first out"
            ));
        }
        let (input, output) = (self.act[k], self.act[k + 1]);
        match op {
            Op::ForwardNoSave(_) | Op::ForwardCheckpoint(_) => {
                if input == NONE {
                    return Err(format!("a_{k} is not live"));
                }
                debug_assert_eq!(output, NONE);
                let consume = matches!(op, Op::ForwardNoSave(_));
                if consume && input != PLAIN {
                    return Err(format!(
                        "a_{k} is a checkpoint or a saved set, which only a backward frees"
                    ));
                }
                let during = self.mem + sz.act[k + 1] + sz.fwd_tmp[k];
                self.mem += sz.act[k + 1];
                self.act[k + 1] = PLAIN;
                if consume {
                    self.mem -= sz.act[k];
                    self.act[k] = NONE;
                } else if input == PLAIN {
                    self.act[k] = CHECKPOINT;
                }
                Ok(during)
            }
            Op::ForwardSaveAll(_) => {
                if input == NONE {
                    return Err(format!("a_{k} is not live"));
                }
                debug_assert_eq!(output, NONE);
                let during = self.mem + sz.saved[k] + sz.save_fwd_tmp[k];
                self.mem += sz.saved[k];
                self.act[k + 1] = SAVED;
                if input == PLAIN && sz.frees_input[k] {
                    self.mem -= sz.act[k];
                    self.act[k] = FREED;
                }
                Ok(during)
            }
            Op::Backward(_) => {
                if self.backward_from != k + 1 {
                    return Err(format!("δ_{} is not live", k + 1));
                }
                if output != SAVED {
                    return Err(format!("ā_{} is not live", k + 1));
                }
                if input == NONE {
                    return Err(format!("a_{k} is not live"));
                }
                let during = self.mem + sz.bwd_out[k] + sz.bwd_tmp[k];
                self.mem = self.mem + sz.grad[k] - sz.grad[k + 1] - sz.saved[k];
                self.act[k + 1] = NONE;
                if input == FREED {
                    self.act[k] = NONE;
                } else if input != SAVED {
                    self.mem -= sz.act[k];
                    self.act[k] = NONE;
                }
                self.backward_from = k;
                Ok(during)
            }
        }
    }
}
