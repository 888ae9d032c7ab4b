//! Bindings of `crate::sharding`: meshes, specs, layout paths and costs,
//! spec enumeration, the layout cache.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{count_arg, counts_arg, invalid_argument, IntoPyResult};
use crate::sharding::layout::cache::{cache_stats, clear_layout_cache};
use crate::sharding::layout::{heuristic, layout_context, LayoutContext, LayoutProblem};
use crate::sharding::mesh::{Collective, DeviceMesh};
use crate::sharding::spec::ShardingSpec;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMesh>()?;
    m.add_class::<PyCollectivePlan>()?;
    m.add_class::<PyCollectiveStep>()?;
    m.add_class::<PySpec>()?;
    m.add_class::<PyStep>()?;
    m.add_class::<PyPath>()?;
    m.add_function(wrap_pyfunction!(layout_path, m)?)?;
    m.add_function(wrap_pyfunction!(resharding_costs, m)?)?;
    m.add_function(wrap_pyfunction!(conversion_network, m)?)?;
    m.add_function(wrap_pyfunction!(enumerate_specs, m)?)?;
    m.add_function(wrap_pyfunction!(layout_cache_stats, m)?)?;
    m.add_function(wrap_pyfunction!(py_clear_layout_cache, m)?)?;
    Ok(())
}

/// The native device mesh; `automap.DeviceMesh` wraps it.
#[pyclass(name = "Mesh", module = "automap._core", frozen)]
struct PyMesh {
    inner: DeviceMesh,
}

#[pymethods]
impl PyMesh {
    #[new]
    #[pyo3(signature = (shape, ranks, alpha_s, bandwidth_bytes_per_s, reduce_scatter_as_all_reduce=false))]
    fn new(
        shape: &Bound<'_, PyAny>,
        ranks: Option<&Bound<'_, PyAny>>,
        alpha_s: Vec<f64>,
        bandwidth_bytes_per_s: Vec<f64>,
        reduce_scatter_as_all_reduce: bool,
    ) -> PyResult<Self> {
        let shape = counts_arg("shape", shape)?;
        let ranks = match ranks {
            None => None,
            Some(r) => Some(
                counts_arg("ranks", r)?
                    .into_iter()
                    .map(|r| r as i64)
                    .collect(),
            ),
        };
        Ok(PyMesh {
            inner: DeviceMesh::new(shape, ranks, alpha_s, bandwidth_bytes_per_s)
                .py()?
                .with_reduce_scatter_as_all_reduce(reduce_scatter_as_all_reduce),
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
    #[getter]
    fn reduce_scatter_as_all_reduce(&self) -> bool {
        self.inner.reduce_scatter_as_all_reduce()
    }
    fn coordinate(&self, rank: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        self.inner.coordinate(count_arg("rank", rank)? as i64).py()
    }
    fn rank_at(&self, coordinate: &Bound<'_, PyAny>) -> PyResult<i64> {
        self.inner
            .rank_at(&counts_arg("coordinate", coordinate)?)
            .py()
    }
    fn axis_groups(&self, axes: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<i64>>> {
        self.inner.axis_groups(&counts_arg("axes", axes)?).py()
    }
    fn collective_cost_s(&self, kind: &str, nbytes: f64, axes: &Bound<'_, PyAny>) -> PyResult<f64> {
        let kind = collective_arg(kind, nbytes)?;
        self.inner
            .collective_cost_s(kind, nbytes, &counts_arg("axes", axes)?)
            .py()
    }
    /// The algorithm `collective_cost_s` prices: flat or per-axis steps.
    fn collective_plan(
        &self,
        kind: &str,
        nbytes: f64,
        axes: &Bound<'_, PyAny>,
    ) -> PyResult<PyCollectivePlan> {
        let kind = collective_arg(kind, nbytes)?;
        let plan = self
            .inner
            .collective_plan(kind, nbytes, &counts_arg("axes", axes)?)
            .py()?;
        Ok(PyCollectivePlan {
            kind: plan.kind.name(),
            nbytes: plan.bytes,
            flat: plan.is_flat(),
            cost_s: plan.cost_s,
            steps: plan
                .steps
                .into_iter()
                .map(|s| PyCollectiveStep {
                    kind: s.kind.name(),
                    axes: s.axes,
                    nbytes: s.bytes,
                    cost_s: s.cost_s,
                })
                .collect(),
        })
    }
}

fn collective_arg(kind: &str, nbytes: f64) -> PyResult<Collective> {
    let Some(kind) = Collective::from_name(kind) else {
        return Err(invalid_argument(format!(
            "unknown collective {kind:?}; expected all_gather, reduce_scatter, all_reduce, \
             all_to_all or broadcast"
        )));
    };
    if !(nbytes.is_finite() && nbytes >= 0.0) {
        return Err(invalid_argument(format!(
            "nbytes must be finite and >= 0, got {nbytes}"
        )));
    }
    Ok(kind)
}

/// One step of a collective's algorithm: `kind` over the devices along `axes`
/// on a per-device buffer of `nbytes`.
#[pyclass(name = "CollectiveStep", module = "automap._core", frozen)]
#[derive(Clone)]
struct PyCollectiveStep {
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    axes: Vec<usize>,
    #[pyo3(get)]
    nbytes: f64,
    #[pyo3(get)]
    cost_s: f64,
}

#[pymethods]
impl PyCollectiveStep {
    fn __repr__(&self) -> String {
        format!(
            "<{} axes {:?}, {} bytes, {:.3e} s>",
            self.kind, self.axes, self.nbytes, self.cost_s
        )
    }
}

/// The chosen algorithm of a collective: its steps in execution order (one
/// step when `flat`, none for a group of one device) and their summed cost.
#[pyclass(name = "CollectivePlan", module = "automap._core", frozen)]
struct PyCollectivePlan {
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    nbytes: f64,
    #[pyo3(get)]
    flat: bool,
    #[pyo3(get)]
    cost_s: f64,
    #[pyo3(get)]
    steps: Vec<PyCollectiveStep>,
}

#[pymethods]
impl PyCollectivePlan {
    fn __repr__(&self) -> String {
        let steps: Vec<String> = self
            .steps
            .iter()
            .map(|s| format!("{} {:?}", s.kind, s.axes))
            .collect();
        format!(
            "<CollectivePlan {} of {} bytes: {} ({:.3e} s)>",
            self.kind,
            self.nbytes,
            steps.join(", "),
            self.cost_s
        )
    }
}

/// A mesh argument: the native mesh or anything holding one in `_native`.
pub(crate) fn native_mesh(obj: &Bound<'_, PyAny>) -> PyResult<DeviceMesh> {
    if let Ok(m) = obj.cast::<PyMesh>() {
        return Ok(m.get().inner.clone());
    }
    match obj.getattr("_native") {
        Ok(native) => Ok(native.cast::<PyMesh>()?.get().inner.clone()),
        Err(_) => Err(invalid_argument(format!(
            "mesh must be an automap.DeviceMesh, got {}",
            obj.get_type().name()?
        ))),
    }
}

/// Bytes per element; `LayoutProblem::new` checks the range.
fn dtype_bytes_arg(dtype_bytes: i64) -> PyResult<usize> {
    usize::try_from(dtype_bytes).map_err(|_| {
        invalid_argument(format!(
            "dtype_bytes must be 1 to 16 (bytes per element), got {dtype_bytes}"
        ))
    })
}

fn to_spec_error(msg: String) -> PyErr {
    super::to_py(crate::error::AutomapError::InvalidSpec(msg))
}

/// A spec argument: a `ShardingSpec` or its string form.
fn native_spec(obj: &Bound<'_, PyAny>) -> PyResult<ShardingSpec> {
    if let Ok(s) = obj.cast::<PySpec>() {
        return Ok(s.get().inner);
    }
    let Ok(text) = obj.extract::<String>() else {
        return Err(to_spec_error(format!(
            "a sharding spec must be an automap.ShardingSpec or a string such as \"S0R\", got {}",
            obj.get_type().name()?
        )));
    };
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
    fn from_dims(dims: &Bound<'_, PyAny>) -> PyResult<Self> {
        let not_a_list = || {
            invalid_argument(
                "dims must be a sequence of sequences of mesh axes, e.g. [[0, 1], []] for S01R",
            )
        };
        if dims.is_instance_of::<pyo3::types::PyString>() {
            return Err(not_a_list());
        }
        let dims = dims
            .try_iter()
            .map_err(|_| not_a_list())?
            .map(|d| counts_arg("each entry of dims", &d?))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PySpec {
            inner: ShardingSpec::from_dims(&dims).py()?,
        })
    }
    #[staticmethod]
    fn replicated(rank: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PySpec {
            inner: ShardingSpec::replicated(count_arg("rank", rank)?).py()?,
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
    fn validate(&self, shape: &Bound<'_, PyAny>, mesh: &Bound<'_, PyAny>) -> PyResult<()> {
        let shape = counts_arg("shape", shape)?;
        self.inner.validate(&shape, &native_mesh(mesh)?).py()
    }
    fn local_shape(
        &self,
        shape: &Bound<'_, PyAny>,
        mesh: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<usize>> {
        let shape = counts_arg("shape", shape)?;
        self.inner.local_shape(&shape, &native_mesh(mesh)?).py()
    }
    /// The [start, stop) range of every dim held by the device at `rank`.
    fn local_slices(
        &self,
        shape: &Bound<'_, PyAny>,
        mesh: &Bound<'_, PyAny>,
        rank: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, usize)>> {
        let shape = counts_arg("shape", shape)?;
        let rank = count_arg("rank", rank)? as i64;
        self.inner
            .local_slices(&shape, &native_mesh(mesh)?, rank)
            .py()
    }
    fn shard_count(&self, mesh: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.inner
            .checked_shard_count(native_mesh(mesh)?.shape())
            .py()
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
    path: &crate::sharding::layout::LayoutPath,
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
    shape: &Bound<'_, PyAny>,
    dtype_bytes: i64,
    method: &str,
) -> PyResult<PyPath> {
    let (mesh, src, dst) = (native_mesh(mesh)?, native_spec(src)?, native_spec(dst)?);
    let shape = counts_arg("shape", shape)?;
    let ctx = layout_context(&mesh, &shape, dtype_bytes_arg(dtype_bytes)?).py()?;
    match method {
        "optimal" => {
            let path = py.detach(|| ctx.path(&src, &dst)).py()?;
            path_to_py(py, &path, ctx.problem())
        }
        "heuristic" => {
            ctx.problem().validate(&src).py()?;
            ctx.problem().validate(&dst).py()?;
            let path = heuristic::heuristic_path(ctx.problem(), src, dst).py()?;
            path_to_py(py, &path, ctx.problem())
        }
        other => Err(invalid_argument(format!(
            "method must be \"optimal\" or \"heuristic\", got {other:?}"
        ))),
    }
}

/// Numbers as a native-endian byte buffer (numpy views it without a copy).
fn ne_bytes<'py, T: Copy + NeBytes>(py: Python<'py>, v: &[T]) -> Bound<'py, PyBytes> {
    PyBytes::new(
        py,
        &v.iter().flat_map(|x| x.ne_bytes()).collect::<Vec<u8>>(),
    )
}

trait NeBytes {
    fn ne_bytes(self) -> Vec<u8>;
}

impl NeBytes for f64 {
    fn ne_bytes(self) -> Vec<u8> {
        self.to_ne_bytes().to_vec()
    }
}

impl NeBytes for u32 {
    fn ne_bytes(self) -> Vec<u8> {
        self.to_ne_bytes().to_vec()
    }
}

/// The layout context and native specs of a (srcs x dsts) question.
fn pair_arguments(
    mesh: &Bound<'_, PyAny>,
    srcs: &[Bound<'_, PyAny>],
    dsts: &[Bound<'_, PyAny>],
    shape: &Bound<'_, PyAny>,
    dtype_bytes: i64,
) -> PyResult<(Arc<LayoutContext>, Vec<ShardingSpec>, Vec<ShardingSpec>)> {
    let mesh = native_mesh(mesh)?;
    let srcs = srcs.iter().map(native_spec).collect::<PyResult<Vec<_>>>()?;
    let dsts = dsts.iter().map(native_spec).collect::<PyResult<Vec<_>>>()?;
    let shape = counts_arg("shape", shape)?;
    let ctx = layout_context(&mesh, &shape, dtype_bytes_arg(dtype_bytes)?).py()?;
    Ok((ctx, srcs, dsts))
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
    shape: &Bound<'py, PyAny>,
    dtype_bytes: i64,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let (ctx, srcs, dsts) = pair_arguments(mesh, &srcs, &dsts, shape, dtype_bytes)?;
    let m = py.detach(|| ctx.cost_matrix(&srcs, &dsts)).py()?;
    Ok((ne_bytes(py, &m.forward_s), ne_bytes(py, &m.backward_s)))
}

/// The optimal paths of every (src, dst) pair as one network: (number of
/// specs, positions of `srcs`, positions of `dsts`, arc tails, arc heads as
/// u32 buffers, arc seconds as an f64 buffer).
#[pyfunction]
#[pyo3(signature = (mesh, srcs, dsts, shape, dtype_bytes = 4))]
#[allow(clippy::type_complexity)]
fn conversion_network<'py>(
    py: Python<'py>,
    mesh: &Bound<'py, PyAny>,
    srcs: Vec<Bound<'py, PyAny>>,
    dsts: Vec<Bound<'py, PyAny>>,
    shape: &Bound<'py, PyAny>,
    dtype_bytes: i64,
) -> PyResult<(
    usize,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
)> {
    let (ctx, srcs, dsts) = pair_arguments(mesh, &srcs, &dsts, shape, dtype_bytes)?;
    let net = py.detach(|| ctx.conversion_network(&srcs, &dsts)).py()?;
    Ok((
        net.num_specs,
        ne_bytes(py, &net.src_pos),
        ne_bytes(py, &net.dst_pos),
        ne_bytes(py, &net.arc_from),
        ne_bytes(py, &net.arc_to),
        ne_bytes(py, &net.arc_cost_s),
    ))
}

/// Every valid spec of `shape` on `mesh`.
#[pyfunction]
fn enumerate_specs(
    py: Python<'_>,
    shape: &Bound<'_, PyAny>,
    mesh: &Bound<'_, PyAny>,
) -> PyResult<Vec<PySpec>> {
    let shape = counts_arg("shape", shape)?;
    let mesh = native_mesh(mesh)?;
    let specs = py
        .detach(|| crate::sharding::enumerate::enumerate_specs(&shape, mesh.shape()))
        .py()?;
    Ok(specs.into_iter().map(|inner| PySpec { inner }).collect())
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
