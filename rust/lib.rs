//! automap's native core: device meshes and their collective costs, sharding
//! specs, and the layout manager (conversion search with a shared cache).
//! Pure Rust; the Python bindings live in `python.rs` behind the `python` feature.

pub mod blocks;
pub mod enumerate;
pub mod error;
pub mod layout;
pub mod linearize;
pub mod mesh;
pub mod rotor;
pub mod spec;
pub mod strategy;

#[cfg(feature = "python")]
mod python;
#[cfg(feature = "python")]
mod python_rotor;

pub use enumerate::enumerate_specs;
pub use error::{AutomapError, Result};
pub use layout::cache::{cache_stats, clear_layout_cache, CostMatrix};
pub use layout::heuristic::heuristic_path;
pub use layout::search::optimal_path;
pub use layout::{layout_context, LayoutContext, LayoutPath, LayoutProblem, LayoutStep, StepKind};
pub use mesh::{Collective, DeviceMesh};
pub use spec::ShardingSpec;
