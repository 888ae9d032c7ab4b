//! Python bindings (the `automap._core` module). Bindings only: every
//! behaviour lives in the pure-Rust modules. Errors become the classes of
//! `automap.errors`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyType};

use crate::blocks::{self, BlockNode};
use crate::error::AutomapError;
use crate::layout::cache::{cache_stats, clear_layout_cache};
use crate::layout::{heuristic, layout_context, LayoutProblem};
use crate::linearize::{self as linear, LinearNode};
use crate::mesh::{Collective, DeviceMesh};
use crate::spec::ShardingSpec;
use crate::strategy::einsum::{self, CostModel, EinsumSignature};
use crate::strategy::reshape;

pub(crate) fn error_class(py: Python<'_>, name: &str) -> PyResult<Py<PyType>> {
    static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let module = MODULE.get_or_try_init(py, || {
        PyModule::import(py, "automap.errors").map(Bound::unbind)
    })?;
    Ok(module
        .bind(py)
        .getattr(name)?
        .cast_into::<PyType>()?
        .unbind())
}

fn to_py(e: AutomapError) -> PyErr {
    Python::attach(|py| {
        let name = match e {
            AutomapError::InvalidSpec(_) => "InvalidSpecError",
            AutomapError::InvalidMesh(_) => "InvalidMeshError",
        };
        match error_class(py, name) {
            Ok(cls) => PyErr::from_type(cls.into_bound(py), e.to_string()),
            Err(err) => err,
        }
    })
}

trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for crate::error::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// The native device mesh; `automap.DeviceMesh` wraps it.
#[pyclass(name = "Mesh", module = "automap._core", frozen)]
struct PyMesh {
    inner: DeviceMesh,
}

#[pymethods]
impl PyMesh {
    #[new]
    #[pyo3(signature = (shape, ranks, alpha_s, bandwidth_bytes_per_s))]
    fn new(
        shape: Vec<usize>,
        ranks: Option<Vec<i64>>,
        alpha_s: Vec<f64>,
        bandwidth_bytes_per_s: Vec<f64>,
    ) -> PyResult<Self> {
        Ok(PyMesh {
            inner: DeviceMesh::new(shape, ranks, alpha_s, bandwidth_bytes_per_s).py()?,
        })
    }

    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.inner.shape().to_vec()
    }
    #[getter]
    fn ranks(&self) -> Vec<i64> {
        self.inner.ranks().to_vec()
    }
    #[getter]
    fn alpha_s(&self) -> Vec<f64> {
        self.inner.alpha_s().to_vec()
    }
    #[getter]
    fn bandwidth_bytes_per_s(&self) -> Vec<f64> {
        self.inner.bandwidth_bytes_per_s().to_vec()
    }
    fn coordinate(&self, rank: i64) -> PyResult<Vec<usize>> {
        self.inner.coordinate(rank).py()
    }
    fn rank_at(&self, coordinate: Vec<usize>) -> PyResult<i64> {
        self.inner.rank_at(&coordinate).py()
    }
    fn axis_groups(&self, axes: Vec<usize>) -> PyResult<Vec<Vec<i64>>> {
        self.inner.axis_groups(&axes).py()
    }
    fn collective_cost_s(&self, kind: &str, nbytes: f64, axes: Vec<usize>) -> PyResult<f64> {
        let Some(kind) = Collective::from_name(kind) else {
            return Err(PyValueError::new_err(format!(
                "unknown collective {kind:?}; expected all_gather, reduce_scatter, all_reduce, \
                 all_to_all or broadcast"
            )));
        };
        if !(nbytes.is_finite() && nbytes >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "nbytes must be finite and >= 0, got {nbytes}"
            )));
        }
        self.inner.collective_cost_s(kind, nbytes, &axes).py()
    }
}

/// A mesh argument: the native mesh or anything holding one in `_native`.
fn native_mesh(obj: &Bound<'_, PyAny>) -> PyResult<DeviceMesh> {
    if let Ok(m) = obj.cast::<PyMesh>() {
        return Ok(m.get().inner.clone());
    }
    match obj.getattr("_native") {
        Ok(native) => Ok(native.cast::<PyMesh>()?.get().inner.clone()),
        Err(_) => Err(PyValueError::new_err("expected an automap.DeviceMesh")),
    }
}

/// A spec argument: a `ShardingSpec` or its string form.
fn native_spec(obj: &Bound<'_, PyAny>) -> PyResult<ShardingSpec> {
    if let Ok(s) = obj.cast::<PySpec>() {
        return Ok(s.get().inner);
    }
    let text: String = obj.extract()?;
    ShardingSpec::parse(&text).py()
}

#[pyclass(name = "ShardingSpec", module = "automap._core", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
struct PySpec {
    inner: ShardingSpec,
}

#[pymethods]
impl PySpec {
    /// Parse the canonical form, e.g. "S01R".
    #[staticmethod]
    fn parse(text: &str) -> PyResult<Self> {
        Ok(PySpec {
            inner: ShardingSpec::parse(text).py()?,
        })
    }
    /// From the mesh axes of each dim, e.g. [[0, 1], []] for "S01R".
    #[staticmethod]
    fn from_dims(dims: Vec<Vec<usize>>) -> PyResult<Self> {
        Ok(PySpec {
            inner: ShardingSpec::from_dims(&dims).py()?,
        })
    }
    #[staticmethod]
    fn replicated(rank: usize) -> PyResult<Self> {
        Ok(PySpec {
            inner: ShardingSpec::replicated(rank).py()?,
        })
    }
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    /// The ordered mesh axes of every dim.
    #[getter]
    fn dims(&self) -> Vec<Vec<usize>> {
        (0..self.inner.rank())
            .map(|d| {
                self.inner
                    .dim_axes(d)
                    .as_slice()
                    .iter()
                    .map(|&a| a as usize)
                    .collect()
            })
            .collect()
    }
    #[getter]
    fn is_replicated(&self) -> bool {
        self.inner.is_replicated()
    }
    fn validate(&self, shape: Vec<usize>, mesh: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.validate(&shape, &native_mesh(mesh)?).py()
    }
    fn local_shape(&self, shape: Vec<usize>, mesh: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        self.inner.local_shape(&shape, &native_mesh(mesh)?).py()
    }
    /// The [start, stop) range of every dim held by the device at `rank`.
    fn local_slices(
        &self,
        shape: Vec<usize>,
        mesh: &Bound<'_, PyAny>,
        rank: i64,
    ) -> PyResult<Vec<(usize, usize)>> {
        self.inner
            .local_slices(&shape, &native_mesh(mesh)?, rank)
            .py()
    }
    fn shard_count(&self, mesh: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.inner.shard_count(native_mesh(mesh)?.shape()))
    }
    fn __str__(&self) -> String {
        self.inner.to_string()
    }
    fn __repr__(&self) -> String {
        format!("ShardingSpec({:?})", self.inner.to_string())
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        Ok((
            slf.get_type().getattr("parse")?,
            (slf.get().inner.to_string(),),
        ))
    }
}

#[pyclass(name = "LayoutStep", module = "automap._core", frozen)]
struct PyStep {
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    axis: usize,
    /// The dim that loses the axis (all_gather, all_to_all) or gains it (shard).
    #[pyo3(get)]
    dim: usize,
    /// The dim that gains the axis in an all_to_all.
    #[pyo3(get)]
    to_dim: Option<usize>,
    #[pyo3(get)]
    before: PySpec,
    #[pyo3(get)]
    after: PySpec,
    #[pyo3(get)]
    forward_cost_s: f64,
    #[pyo3(get)]
    backward_cost_s: f64,
}

#[pymethods]
impl PyStep {
    #[getter]
    fn cost_s(&self) -> f64 {
        self.forward_cost_s + self.backward_cost_s
    }
    fn __repr__(&self) -> String {
        let what = match self.to_dim {
            Some(t) => format!("{} axis {} dim {} -> {}", self.kind, self.axis, self.dim, t),
            None => format!("{} axis {} dim {}", self.kind, self.axis, self.dim),
        };
        format!(
            "<{what}: {} -> {}, {:.3e} s>",
            self.before.inner,
            self.after.inner,
            self.cost_s()
        )
    }
}

#[pyclass(name = "LayoutPath", module = "automap._core", frozen)]
struct PyPath {
    #[pyo3(get)]
    src: PySpec,
    #[pyo3(get)]
    dst: PySpec,
    steps: Vec<Py<PyStep>>,
    #[pyo3(get)]
    shape: Vec<usize>,
    #[pyo3(get)]
    dtype_bytes: usize,
    #[pyo3(get)]
    forward_cost_s: f64,
    #[pyo3(get)]
    backward_cost_s: f64,
}

#[pymethods]
impl PyPath {
    #[getter]
    fn steps(&self, py: Python<'_>) -> Vec<Py<PyStep>> {
        self.steps.iter().map(|s| s.clone_ref(py)).collect()
    }
    /// Training cost: forward plus backward seconds.
    #[getter]
    fn cost_s(&self) -> f64 {
        self.forward_cost_s + self.backward_cost_s
    }
    fn __len__(&self) -> usize {
        self.steps.len()
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        let mut specs = vec![self.src.inner.to_string()];
        specs.extend(
            self.steps
                .iter()
                .map(|s| s.bind(py).get().after.inner.to_string()),
        );
        format!(
            "<LayoutPath {} ({} steps, {:.3e} s)>",
            specs.join(" -> "),
            self.steps.len(),
            self.cost_s()
        )
    }
}

fn path_to_py(
    py: Python<'_>,
    path: &crate::layout::LayoutPath,
    problem: &LayoutProblem,
) -> PyResult<PyPath> {
    let steps = path
        .steps
        .iter()
        .map(|s| {
            Py::new(
                py,
                PyStep {
                    kind: s.kind.name(),
                    axis: s.axis,
                    dim: s.dim,
                    to_dim: s.to_dim,
                    before: PySpec { inner: s.before },
                    after: PySpec { inner: s.after },
                    forward_cost_s: s.forward_cost_s,
                    backward_cost_s: s.backward_cost_s,
                },
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PyPath {
        src: PySpec { inner: path.src },
        dst: PySpec { inner: path.dst },
        steps,
        shape: problem.shape().to_vec(),
        dtype_bytes: problem.dtype_bytes(),
        forward_cost_s: path.forward_cost_s,
        backward_cost_s: path.backward_cost_s,
    })
}

/// The conversion from `src` to `dst`: "optimal" (cached, exact) or
/// "heuristic" (MAP's greedy search, uncached, for comparison).
#[pyfunction]
#[pyo3(signature = (mesh, src, dst, shape, dtype_bytes = 4, method = "optimal"))]
fn layout_path(
    py: Python<'_>,
    mesh: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    shape: Vec<usize>,
    dtype_bytes: usize,
    method: &str,
) -> PyResult<PyPath> {
    let (mesh, src, dst) = (native_mesh(mesh)?, native_spec(src)?, native_spec(dst)?);
    let ctx = layout_context(&mesh, &shape, dtype_bytes);
    match method {
        "optimal" => {
            let path = ctx.path(&src, &dst).py()?;
            path_to_py(py, &path, ctx.problem())
        }
        "heuristic" => {
            ctx.problem().validate(&src).py()?;
            ctx.problem().validate(&dst).py()?;
            let path = heuristic::heuristic_path(ctx.problem(), src, dst);
            path_to_py(py, &path, ctx.problem())
        }
        other => Err(PyValueError::new_err(format!(
            "unknown method {other:?}; expected \"optimal\" or \"heuristic\""
        ))),
    }
}

/// Forward and backward seconds of every (src, dst) pair, as two row-major
/// float64 buffers (the Python side views them as numpy arrays).
#[pyfunction]
#[pyo3(signature = (mesh, srcs, dsts, shape, dtype_bytes = 4))]
fn resharding_costs<'py>(
    py: Python<'py>,
    mesh: &Bound<'py, PyAny>,
    srcs: Vec<Bound<'py, PyAny>>,
    dsts: Vec<Bound<'py, PyAny>>,
    shape: Vec<usize>,
    dtype_bytes: usize,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let mesh = native_mesh(mesh)?;
    let srcs = srcs.iter().map(native_spec).collect::<PyResult<Vec<_>>>()?;
    let dsts = dsts.iter().map(native_spec).collect::<PyResult<Vec<_>>>()?;
    let ctx = layout_context(&mesh, &shape, dtype_bytes);
    let m = py.detach(|| ctx.cost_matrix(&srcs, &dsts)).py()?;
    let as_bytes = |v: &[f64]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
    Ok((
        PyBytes::new(py, &as_bytes(&m.forward_s)),
        PyBytes::new(py, &as_bytes(&m.backward_s)),
    ))
}

/// Every valid spec of `shape` on `mesh`.
#[pyfunction]
fn enumerate_specs(shape: Vec<usize>, mesh: &Bound<'_, PyAny>) -> PyResult<Vec<PySpec>> {
    let mesh = native_mesh(mesh)?;
    Ok(crate::enumerate::enumerate_specs(&shape, mesh.shape())
        .into_iter()
        .map(|inner| PySpec { inner })
        .collect())
}

/// Strategies of a node in letter form (see `strategy::einsum`): input and
/// output spec strings per strategy, a float64 buffer of
/// (compute_s, forward_comm_s, backward_comm_s) per strategy, and per
/// strategy (partial axes, scatter dim or None, gradient-reduction axes per input).
#[pyfunction]
#[pyo3(signature = (mesh, flops_per_s, letter_sizes, unshardable, inputs, outputs, input_bytes,
                    output_bytes, input_needs_grad, input_additive, flops))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn einsum_strategies<'py>(
    py: Python<'py>,
    mesh: &Bound<'py, PyAny>,
    flops_per_s: f64,
    letter_sizes: Vec<usize>,
    unshardable: Vec<bool>,
    inputs: Vec<Vec<usize>>,
    outputs: Vec<Vec<usize>>,
    input_bytes: Vec<f64>,
    output_bytes: Vec<f64>,
    input_needs_grad: Vec<bool>,
    input_additive: Vec<bool>,
    flops: f64,
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
    };
    let strategies = einsum::einsum_strategies(&sig, &cost).map_err(PyValueError::new_err)?;
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
    let pairs = reshape::reshape_strategies(&input_shape, &output_shape, mesh.shape())
        .map_err(PyValueError::new_err)?;
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
        return Err(PyValueError::new_err(
            "detect_blocks: the four lists must have equal lengths",
        ));
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
        .into_iter()
        .map(|c| (c.container, c.instances))
        .collect())
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
        return Err(PyValueError::new_err(
            "linearize: the four lists must have equal lengths",
        ));
    }
    if let Some((i, p)) = parents
        .iter()
        .enumerate()
        .find_map(|(i, ps)| ps.iter().find(|&&p| p >= i).map(|&p| (i, p)))
    {
        return Err(PyValueError::new_err(format!(
            "node {i} has parent {p}: parents must come first"
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
    Ok(linear::linearize(&nodes))
}

/// (cache hits, searches) of the process-wide layout cache.
#[pyfunction]
fn layout_cache_stats() -> (u64, u64) {
    cache_stats()
}

#[pyfunction(name = "clear_layout_cache")]
fn py_clear_layout_cache() {
    clear_layout_cache()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMesh>()?;
    m.add_class::<PySpec>()?;
    m.add_class::<PyStep>()?;
    m.add_class::<PyPath>()?;
    m.add_function(wrap_pyfunction!(layout_path, m)?)?;
    m.add_function(wrap_pyfunction!(resharding_costs, m)?)?;
    m.add_function(wrap_pyfunction!(enumerate_specs, m)?)?;
    m.add_function(wrap_pyfunction!(layout_cache_stats, m)?)?;
    m.add_function(wrap_pyfunction!(einsum_strategies, m)?)?;
    m.add_function(wrap_pyfunction!(reshape_strategies, m)?)?;
    m.add_function(wrap_pyfunction!(detect_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(linearize, m)?)?;
    crate::python_rotor::register(m)?;
    m.add_function(wrap_pyfunction!(py_clear_layout_cache, m)?)?;
    Ok(())
}
