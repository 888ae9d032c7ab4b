//! Typed errors of the native core. Each variant maps to one Python exception
//! class of `automap.errors` (see `python/mod.rs`); the message is what the user
//! reads: the argument at fault, its value and what is allowed.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AutomapError {
    /// A sharding spec that cannot be parsed, or that does not fit a shape or a mesh.
    InvalidSpec(String),
    /// A mesh whose shape, ranks or link parameters are inconsistent.
    InvalidMesh(String),
    /// An argument outside what is allowed (a negative or non-finite number,
    /// an index out of range, lists of unequal lengths).
    InvalidArgument(String),
    /// An input of a valid form whose size passes one of the core's caps
    /// (devices in a mesh, specs of a tensor, strategies of a node, bytes).
    LimitExceeded(String),
}

impl fmt::Display for AutomapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AutomapError::InvalidSpec(m)
            | AutomapError::InvalidMesh(m)
            | AutomapError::InvalidArgument(m)
            | AutomapError::LimitExceeded(m) => f.write_str(m),
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

pub(crate) fn invalid_argument<T>(msg: impl Into<String>) -> Result<T> {
    Err(AutomapError::InvalidArgument(msg.into()))
}

pub(crate) fn limit_exceeded<T>(msg: impl Into<String>) -> Result<T> {
    Err(AutomapError::LimitExceeded(msg.into()))
}

/// Checks a graph given as lists of earlier nodes (graph order): list `i` may
/// name only nodes `< i`. `what` names the function and the lists, e.g.
/// "linearize: parents".
pub(crate) fn check_earlier<'a>(
    what: &str,
    lists: impl IntoIterator<Item = &'a [usize]>,
) -> Result<()> {
    for (i, list) in lists.into_iter().enumerate() {
        if let Some(&p) = list.iter().find(|&&p| p >= i) {
            return invalid_argument(format!(
                "{what} of node {i} name node {p}; they must be earlier nodes (< {i})"
            ));
        }
    }
    Ok(())
}

/// The product of `sizes`, or None when it does not fit a `usize`.
pub(crate) fn checked_product(sizes: impl IntoIterator<Item = usize>) -> Option<usize> {
    sizes
        .into_iter()
        .try_fold(1usize, |acc, n| acc.checked_mul(n))
}
