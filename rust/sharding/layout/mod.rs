//! The tensor layout manager (MAP section 4.3): how to turn one sharding spec
//! into another with collectives, at what price, and a process-wide cache of
//! the answers.
//!
//! - `moves`: the one-step transforms (all-gather, shard, all-to-all) and their costs;
//! - `search`: the exact minimum-cost path (A* with an admissible bound);
//! - `heuristic`: MAP's greedy similarity search, kept as a baseline;
//! - `cache`: contexts (mesh, shape, dtype) that memoise paths, and cost matrices;
//! - `network`: an edge's conversions as a min-cost-flow network (the ILP's flow edges).

pub mod cache;
pub mod heuristic;
pub mod moves;
pub mod network;
pub mod search;

pub use cache::{layout_context, LayoutContext};
pub use moves::{LayoutPath, LayoutProblem, LayoutStep, StepKind};
pub use network::ConversionNetwork;
