//! Python bindings of the rotor checkpointing solver: `solve_rotor` and the
//! classes it returns, and the linearization of a graph into stages.
//! Registered by `_core` through [`register`]. Bindings only; the solvers are
//! `crate::checkpoint::rotor` and `crate::checkpoint::linearize`.

use pyo3::prelude::*;

use super::{error_class, invalid_argument, IntoPyResult};
use crate::checkpoint::linearize::{self as linear, LinearNode};
use crate::checkpoint::rotor::{self, Chain, CheckpointBlock, RotorError, Stage};

/// Add `solve_rotor`, `RotorSchedule` and `CheckpointBlock` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRotorSchedule>()?;
    m.add_class::<PyCheckpointBlock>()?;
    m.add_function(wrap_pyfunction!(solve_rotor, m)?)?;
    m.add_function(wrap_pyfunction!(linearize, m)?)?;
    Ok(())
}

fn to_py(e: RotorError) -> PyErr {
    Python::attach(|py| {
        let (name, args) = match &e {
            RotorError::InfeasibleBudget {
                min_budget_bytes, ..
            } => (
                "InfeasibleBudgetError",
                (e.to_string(), Some(*min_budget_bytes)),
            ),
            RotorError::InvalidChain(msg) | RotorError::InvalidSchedule(msg) => {
                ("InvalidChainError", (msg.clone(), None))
            }
        };
        let made = error_class(py, name).and_then(|cls| {
            let value = match args.1 {
                Some(least) => cls.bind(py).call1((args.0, least))?,
                None => cls.bind(py).call1((args.0,))?,
            };
            Ok(PyErr::from_value(value))
        });
        made.unwrap_or_else(|err| err)
    })
}

/// A `torch.utils.checkpoint` region over stages `start_stage..=end_stage`,
/// with the regions nested in its recomputation.
#[pyclass(name = "CheckpointBlock", module = "automap._core", frozen)]
struct PyCheckpointBlock {
    #[pyo3(get)]
    start_stage: usize,
    #[pyo3(get)]
    end_stage: usize,
    children: Vec<Py<PyCheckpointBlock>>,
}

#[pymethods]
impl PyCheckpointBlock {
    #[getter]
    fn children(&self, py: Python<'_>) -> Vec<Py<PyCheckpointBlock>> {
        self.children.iter().map(|c| c.clone_ref(py)).collect()
    }
    fn __repr__(&self) -> String {
        format!(
            "<CheckpointBlock stages {}..={} ({} nested)>",
            self.start_stage,
            self.end_stage,
            self.children.len()
        )
    }
}

fn blocks_to_py(
    py: Python<'_>,
    blocks: &[CheckpointBlock],
) -> PyResult<Vec<Py<PyCheckpointBlock>>> {
    blocks
        .iter()
        .map(|b| {
            Py::new(
                py,
                PyCheckpointBlock {
                    start_stage: b.start_stage,
                    end_stage: b.end_stage,
                    children: blocks_to_py(py, &b.children)?,
                },
            )
        })
        .collect()
}

/// The optimal activation-checkpoint schedule of a chain.
#[pyclass(name = "RotorSchedule", module = "automap._core", frozen)]
struct PyRotorSchedule {
    /// (op, stage) in execution order; op is "forward_no_save",
    /// "forward_checkpoint", "forward_save_all" or "backward".
    #[pyo3(get)]
    ops: Vec<(&'static str, usize)>,
    blocks: Vec<Py<PyCheckpointBlock>>,
    #[pyo3(get)]
    predicted_time_s: f64,
    #[pyo3(get)]
    peak_memory_bytes: u64,
    #[pyo3(get)]
    no_recompute_time_s: f64,
    #[pyo3(get)]
    budget_bytes: u64,
    #[pyo3(get)]
    slots: usize,
    /// Per op of `ops`: the bytes live while it runs (its outputs and
    /// temporaries included): the predicted memory timeline.
    #[pyo3(get)]
    op_memory_bytes: Vec<u64>,
}

#[pymethods]
impl PyRotorSchedule {
    /// Top-level checkpoint regions; stages outside them run normally.
    #[getter]
    fn blocks(&self, py: Python<'_>) -> Vec<Py<PyCheckpointBlock>> {
        self.blocks.iter().map(|c| c.clone_ref(py)).collect()
    }
    /// Seconds spent recomputing forwards.
    #[getter]
    fn recompute_time_s(&self) -> f64 {
        (self.predicted_time_s - self.no_recompute_time_s).max(0.0)
    }
    fn __repr__(&self) -> String {
        format!(
            "<RotorSchedule {} ops, {} top-level blocks, {:.4e} s, peak {} of {} bytes>",
            self.ops.len(),
            self.blocks.len(),
            self.predicted_time_s,
            self.peak_memory_bytes,
            self.budget_bytes
        )
    }
}

fn column<T: Copy + Default>(
    name: &str,
    values: Option<Vec<T>>,
    len: usize,
    default: Option<&[T]>,
) -> PyResult<Vec<T>> {
    match values {
        Some(v) if v.len() == len => Ok(v),
        Some(v) => Err(to_py(RotorError::InvalidChain(format!(
            "{name} has {} entries; the chain has {len} stages",
            v.len()
        )))),
        None => Ok(default.map_or_else(|| vec![T::default(); len], <[T]>::to_vec)),
    }
}

/// The optimal persistent checkpoint schedule of a chain of stages (per
/// stage: times in seconds, sizes in bytes) within `budget_bytes`, memory cut
/// into `slots` slots. Raises InfeasibleBudgetError (with the smallest budget
/// that fits) when none fits.
#[pyfunction]
#[pyo3(signature = (
    fwd_compute_s, bwd_compute_s, out_bytes, saved_bytes, budget_bytes, *,
    fwd_comm_s = None, bwd_comm_s = None, fwd_tmp_bytes = None, fwd_comm_tmp_bytes = None,
    save_fwd_tmp_bytes = None, bwd_tmp_bytes = None, bwd_comm_tmp_bytes = None, out_grad_bytes = None,
    param_grad_bytes = None, frees_input = None,
    input_bytes = 0, input_grad_bytes = 0, slots = rotor::DEFAULT_SLOTS,
))]
#[allow(clippy::too_many_arguments)]
fn solve_rotor(
    py: Python<'_>,
    fwd_compute_s: Vec<f64>,
    bwd_compute_s: Vec<f64>,
    out_bytes: Vec<u64>,
    saved_bytes: Vec<u64>,
    budget_bytes: u64,
    fwd_comm_s: Option<Vec<f64>>,
    bwd_comm_s: Option<Vec<f64>>,
    fwd_tmp_bytes: Option<Vec<u64>>,
    fwd_comm_tmp_bytes: Option<Vec<u64>>,
    save_fwd_tmp_bytes: Option<Vec<u64>>,
    bwd_tmp_bytes: Option<Vec<u64>>,
    bwd_comm_tmp_bytes: Option<Vec<u64>>,
    out_grad_bytes: Option<Vec<u64>>,
    param_grad_bytes: Option<Vec<u64>>,
    frees_input: Option<Vec<bool>>,
    input_bytes: u64,
    input_grad_bytes: u64,
    slots: usize,
) -> PyResult<PyRotorSchedule> {
    let len = fwd_compute_s.len();
    let bwd_compute_s = column("bwd_compute_s", Some(bwd_compute_s), len, None)?;
    let out_bytes = column("out_bytes", Some(out_bytes), len, None)?;
    let saved_bytes = column("saved_bytes", Some(saved_bytes), len, None)?;
    let fwd_comm_s = column("fwd_comm_s", fwd_comm_s, len, None)?;
    let bwd_comm_s = column("bwd_comm_s", bwd_comm_s, len, None)?;
    let fwd_tmp_bytes = column("fwd_tmp_bytes", fwd_tmp_bytes, len, None)?;
    let fwd_comm_tmp_bytes = column("fwd_comm_tmp_bytes", fwd_comm_tmp_bytes, len, None)?;
    let save_fwd_tmp_bytes = match save_fwd_tmp_bytes {
        Some(v) => Some(column("save_fwd_tmp_bytes", Some(v), len, None)?),
        None => None,
    };
    let bwd_tmp_bytes = column("bwd_tmp_bytes", bwd_tmp_bytes, len, None)?;
    let bwd_comm_tmp_bytes = column("bwd_comm_tmp_bytes", bwd_comm_tmp_bytes, len, None)?;
    let out_grad_bytes = column("out_grad_bytes", out_grad_bytes, len, Some(&out_bytes))?;
    let param_grad_bytes = column("param_grad_bytes", param_grad_bytes, len, None)?;
    let frees_input = column("frees_input", frees_input, len, None)?;
    let stages = (0..len)
        .map(|k| Stage {
            fwd_compute_s: fwd_compute_s[k],
            fwd_comm_s: fwd_comm_s[k],
            bwd_compute_s: bwd_compute_s[k],
            bwd_comm_s: bwd_comm_s[k],
            fwd_tmp_bytes: fwd_tmp_bytes[k],
            fwd_comm_tmp_bytes: fwd_comm_tmp_bytes[k],
            save_fwd_tmp_bytes: save_fwd_tmp_bytes.as_ref().map(|v| v[k]),
            bwd_tmp_bytes: bwd_tmp_bytes[k],
            bwd_comm_tmp_bytes: bwd_comm_tmp_bytes[k],
            out_bytes: out_bytes[k],
            saved_bytes: saved_bytes[k],
            out_grad_bytes: out_grad_bytes[k],
            param_grad_bytes: param_grad_bytes[k],
            frees_input: frees_input[k],
        })
        .collect();
    let chain = Chain::new(stages, input_bytes, input_grad_bytes).map_err(to_py)?;
    let sch = py
        .detach(|| rotor::solve(&chain, budget_bytes, slots))
        .map_err(to_py)?;
    let replay = rotor::simulate(&chain, &sch.ops).map_err(to_py)?;
    Ok(PyRotorSchedule {
        ops: sch.ops.iter().map(|op| (op.name(), op.stage())).collect(),
        blocks: blocks_to_py(py, &sch.blocks)?,
        predicted_time_s: sch.predicted_time_s,
        peak_memory_bytes: sch.peak_memory_bytes,
        no_recompute_time_s: sch.no_recompute_time_s,
        budget_bytes: sch.budget_bytes,
        slots: sch.slots,
        op_memory_bytes: replay.op_memory_bytes,
    })
}

/// Stages of a graph for activation checkpointing (see `linearize`): per
/// node (graph order) its parents and flags; returns node indices per stage.
#[pyfunction]
fn linearize(
    parents: Vec<Vec<usize>>,
    placeholder: Vec<bool>,
    non_differentiable: Vec<bool>,
    inplace: Vec<bool>,
) -> PyResult<Vec<Vec<usize>>> {
    let n = parents.len();
    if placeholder.len() != n || non_differentiable.len() != n || inplace.len() != n {
        return Err(invalid_argument(format!(
            "linearize: parents, placeholder, non_differentiable and inplace must have equal \
             lengths, got {n}, {}, {} and {}",
            placeholder.len(),
            non_differentiable.len(),
            inplace.len()
        )));
    }
    let nodes: Vec<LinearNode> = (0..n)
        .map(|i| LinearNode {
            parents: parents[i].clone(),
            placeholder: placeholder[i],
            non_differentiable: non_differentiable[i],
            inplace: inplace[i],
            communication: false,
        })
        .collect();
    linear::linearize(&nodes).py()
}
