//! automap's native core, one module per pipeline stage it serves (the Python
//! package `automap` has a subpackage of the same name for each):
//!
//! - `sharding`: device meshes and their collective costs, sharding specs, the
//!   layout manager (conversion search with a shared cache);
//! - `solve`: sharding strategies generated from op signatures, block detection;
//! - `checkpoint`: linearization and the rotor checkpointing DP.
//!
//! Pure Rust; the Python bindings live in `python/` behind the `python` feature.
//!
//! Nothing may panic across the Python boundary: every exported function
//! validates its arguments and returns a typed error (`error.rs`), sizes use
//! checked arithmetic, and outside tests the lints below refuse `unwrap`,
//! `expect` and explicit panics; the proptests of `boundary.rs` feed the
//! functions the bindings call arbitrary input.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::todo,
        clippy::unimplemented,
        clippy::unreachable
    )
)]

#[cfg(test)]
mod boundary;
pub mod checkpoint;
pub mod error;
pub mod sharding;
pub mod solve;

#[cfg(feature = "python")]
mod python;

pub use error::{AutomapError, Result};
pub use sharding::enumerate::enumerate_specs;
pub use sharding::layout::cache::{cache_stats, clear_layout_cache, CostMatrix};
pub use sharding::layout::heuristic::heuristic_path;
pub use sharding::layout::search::optimal_path;
pub use sharding::layout::{
    layout_context, LayoutContext, LayoutPath, LayoutProblem, LayoutStep, StepKind,
};
pub use sharding::mesh::{Collective, DeviceMesh};
pub use sharding::spec::ShardingSpec;
