//! Python bindings (the `automap._core` module), one file per stage like the
//! pure-Rust modules they bind: `sharding`, `solve`, `checkpoint`. Bindings
//! only: every behaviour lives in the pure-Rust modules. Errors become the
//! classes of `automap.errors`.

mod checkpoint;
mod sharding;
mod solve;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyString, PyType};

use crate::error::AutomapError;
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

pub(crate) fn to_py(e: AutomapError) -> PyErr {
    Python::attach(|py| {
        let name = match e {
            AutomapError::InvalidSpec(_) => "InvalidSpecError",
            AutomapError::InvalidMesh(_) => "InvalidMeshError",
            AutomapError::InvalidArgument(_) => "InvalidArgumentError",
            AutomapError::LimitExceeded(_) => "LimitExceededError",
        };
        match error_class(py, name) {
            Ok(cls) => PyErr::from_type(cls.into_bound(py), e.to_string()),
            Err(err) => err,
        }
    })
}

pub(crate) trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for crate::error::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// An `InvalidArgumentError` with this message.
pub(crate) fn invalid_argument(msg: impl Into<String>) -> PyErr {
    to_py(AutomapError::InvalidArgument(msg.into()))
}

/// A count or index argument (a Python int >= 0); anything else is an
/// `InvalidArgumentError` naming the argument and the value.
pub(crate) fn count_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let value = if obj.is_instance_of::<PyBool>() {
        None
    } else {
        obj.extract::<i64>().ok()
    };
    match value.and_then(|v| usize::try_from(v).ok()) {
        Some(v) => Ok(v),
        None => Err(invalid_argument(format!(
            "{name} must be an integer >= 0 (and < 2^63), got {}",
            describe(obj)
        ))),
    }
}

/// A list of counts (a shape, a coordinate, mesh axes): a sequence of ints >= 0.
pub(crate) fn counts_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let not_a_list = || {
        invalid_argument(format!(
            "{name} must be a sequence of integers >= 0, got {}",
            describe(obj)
        ))
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(not_a_list());
    }
    let items = obj.try_iter().map_err(|_| not_a_list())?;
    let mut out = Vec::new();
    for item in items {
        let item = item?;
        out.push(
            count_arg(&format!("each entry of {name}"), &item).map_err(|_| {
                invalid_argument(format!(
                    "{name} must be a sequence of integers >= 0, got {} (entry {})",
                    describe(obj),
                    describe(&item)
                ))
            })?,
        );
    }
    Ok(out)
}

/// `repr(obj)`, cut to a readable length.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    let text = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".into());
    if text.chars().count() > 80 {
        format!("{}...", text.chars().take(77).collect::<String>())
    } else {
        text
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    sharding::register(m)?;
    solve::register(m)?;
    checkpoint::register(m)
}
