//! Python bindings (the `automap._core` module), one file per stage like the
//! pure-Rust modules they bind: `sharding`, `solve`, `checkpoint`. Bindings
//! only: every behaviour lives in the pure-Rust modules. Errors become the
//! classes of `automap.errors`.

mod checkpoint;
mod sharding;
mod solve;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    sharding::register(m)?;
    solve::register(m)?;
    checkpoint::register(m)
}
