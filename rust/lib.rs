//! automap's native core, one module per pipeline stage it serves (the Python
//! package `automap` has a subpackage of the same name for each):
//!
//! - `sharding`: device meshes and their collective costs, sharding specs, the
//!   layout manager (conversion search with a shared cache);
//! - `solve`: sharding strategies generated from op signatures, block detection;
//! - `checkpoint`: linearization and the rotor checkpointing DP.
//!
//! Pure Rust; the Python bindings live in `python/` behind the `python` feature.

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
