//! Bindings of `crate::solve`: strategies from op signatures, views, and
//! repeated-block detection.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::sharding::native_mesh;
use super::{invalid_argument, IntoPyResult};
use crate::solve::blocks::{self, BlockNode};
use crate::solve::strategy::einsum::{self, CostModel, EinsumSignature};
use crate::solve::strategy::reshape;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(einsum_strategies, m)?)?;
    m.add_function(wrap_pyfunction!(reshape_strategies, m)?)?;
    m.add_function(wrap_pyfunction!(detect_blocks, m)?)?;
    Ok(())
}

/// Strategies of a node in letter form (see `strategy::einsum`), priced with
/// the device's FLOP rate, memory bandwidth and per-kernel overhead: input and
/// output spec strings per strategy, a float64 buffer of
/// (compute_s, forward_comm_s, backward_comm_s) per strategy, and per
/// strategy (partial axes, scatter dim or None, gradient-reduction axes per input).
#[pyfunction]
#[pyo3(signature = (mesh, flops_per_s, memory_bandwidth_bytes_per_s, op_overhead_s, letter_sizes, unshardable, inputs, outputs, input_bytes,
                    output_bytes, input_needs_grad, input_additive, flops, is_view))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn einsum_strategies<'py>(
    py: Python<'py>,
    mesh: &Bound<'py, PyAny>,
    flops_per_s: f64,
    memory_bandwidth_bytes_per_s: f64,
    op_overhead_s: f64,
    letter_sizes: Vec<usize>,
    unshardable: Vec<bool>,
    inputs: Vec<Vec<usize>>,
    outputs: Vec<Vec<usize>>,
    input_bytes: Vec<f64>,
    output_bytes: Vec<f64>,
    input_needs_grad: Vec<bool>,
    input_additive: Vec<bool>,
    flops: f64,
    is_view: bool,
) -> PyResult<(
    Vec<Vec<String>>,
    Vec<Vec<String>>,
    Bound<'py, PyBytes>,
    Vec<ReductionPlan>,
)> {
    let mesh = native_mesh(mesh)?;
    let cost = CostModel {
        mesh_shape: mesh.shape().to_vec(),
        alpha_s: mesh.alpha_s().to_vec(),
        bandwidth_bytes_per_s: mesh.bandwidth_bytes_per_s().to_vec(),
        flops_per_s,
        memory_bandwidth_bytes_per_s,
        op_overhead_s,
        reduce_scatter_as_all_reduce: mesh.reduce_scatter_as_all_reduce(),
    };
    let sig = EinsumSignature {
        letter_sizes,
        unshardable,
        inputs,
        outputs,
        input_bytes,
        output_bytes,
        input_needs_grad,
        input_additive,
        flops,
        is_view,
    };
    let strategies = py.detach(|| einsum::einsum_strategies(&sig, &cost)).py()?;
    let ins = strategies
        .iter()
        .map(|s| s.inputs.iter().map(|x| x.to_string()).collect())
        .collect();
    let outs = strategies
        .iter()
        .map(|s| s.outputs.iter().map(|x| x.to_string()).collect())
        .collect();
    let costs: Vec<u8> = strategies
        .iter()
        .flat_map(|s| [s.compute_s, s.forward_comm_s, s.backward_comm_s])
        .flat_map(|x| x.to_ne_bytes())
        .collect();
    let reductions = strategies
        .iter()
        .map(|s| {
            (
                s.partial_axes.clone(),
                s.scatter_dim,
                s.grad_reduce_axes.clone(),
            )
        })
        .collect();
    Ok((ins, outs, PyBytes::new(py, &costs), reductions))
}

/// (partial axes, scatter dim, gradient-reduction axes per input) of a strategy.
type ReductionPlan = (Vec<usize>, Option<usize>, Vec<Vec<usize>>);

/// (input spec, output spec) strings of every strategy of a view.
#[pyfunction]
fn reshape_strategies(
    input_shape: Vec<usize>,
    output_shape: Vec<usize>,
    mesh: &Bound<'_, PyAny>,
) -> PyResult<Vec<(String, String)>> {
    let mesh = native_mesh(mesh)?;
    let pairs = reshape::reshape_strategies(&input_shape, &output_shape, mesh.shape()).py()?;
    Ok(pairs
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect())
}

/// Repeated blocks of a graph: per class, (container, instances as lists of
/// node indices, corresponding nodes at equal positions).
#[pyfunction]
fn detect_blocks(
    keys: Vec<String>,
    shape_keys: Vec<String>,
    module_paths: Vec<String>,
    inputs: Vec<Vec<usize>>,
) -> PyResult<Vec<(String, Vec<Vec<usize>>)>> {
    let n = keys.len();
    if shape_keys.len() != n || module_paths.len() != n || inputs.len() != n {
        return Err(invalid_argument(format!(
            "detect_blocks: keys, shape_keys, module_paths and inputs must have equal lengths, \
             got {n}, {}, {} and {}",
            shape_keys.len(),
            module_paths.len(),
            inputs.len()
        )));
    }
    let nodes: Vec<BlockNode> = keys
        .into_iter()
        .zip(shape_keys)
        .zip(module_paths)
        .zip(inputs)
        .map(|(((key, shape_key), module_path), inputs)| BlockNode {
            key,
            shape_key,
            module_path,
            inputs,
        })
        .collect();
    Ok(blocks::detect_blocks(&nodes)
        .py()?
        .into_iter()
        .map(|c| (c.container, c.instances))
        .collect())
}
