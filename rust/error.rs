//! Typed errors of the native core. Each variant maps to one Python exception
//! class of `automap.errors` (see `python/mod.rs`); the message is what the user reads.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AutomapError {
    /// A sharding spec that cannot be parsed, or that does not fit a shape or a mesh.
    InvalidSpec(String),
    /// A mesh whose shape, ranks or link parameters are inconsistent.
    InvalidMesh(String),
}

impl fmt::Display for AutomapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AutomapError::InvalidSpec(m) | AutomapError::InvalidMesh(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for AutomapError {}

pub type Result<T> = std::result::Result<T, AutomapError>;

pub(crate) fn invalid_spec<T>(msg: impl Into<String>) -> Result<T> {
    Err(AutomapError::InvalidSpec(msg.into()))
}

pub(crate) fn invalid_mesh<T>(msg: impl Into<String>) -> Result<T> {
    Err(AutomapError::InvalidMesh(msg.into()))
}
