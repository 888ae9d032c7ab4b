//! Sharding strategies of graph nodes (MAP section 5.1): for a node, every
//! valid choice of input and output specs with its compute and
//! communication time. Op families are described by signatures, not by op:
//!
//! - `einsum`: ops whose dims can be named by letters (contractions,
//!   elementwise with broadcasting, reductions, normalisations, embedding,
//!   convolution, attention, permutes...). Mesh axes are assigned to letters;
//!   what that implies (partial sums, gradient reductions) follows from which
//!   operands carry which letters.
//! - `reshape`: views that merge and split dims; a shard survives when it
//!   sits on the major dim of a merged or split group.
//! - sources (parameters, inputs) take any valid spec: see `enumerate`.

pub mod einsum;
pub mod reshape;

use crate::sharding::spec::ShardingSpec;

/// One way to run a node on the mesh.
#[derive(Debug, Clone, PartialEq)]
pub struct Strategy {
    /// Spec each tensor input must arrive in.
    pub inputs: Vec<ShardingSpec>,
    /// Spec of each output, after any reduction the strategy performs.
    pub outputs: Vec<ShardingSpec>,
    /// Forward + backward compute on one device, seconds.
    pub compute_s: f64,
    /// Collectives the node itself runs in the forward (partial-sum
    /// all-reduce or reduce-scatter), seconds.
    pub forward_comm_s: f64,
    /// Collectives in the backward (reductions of partial input gradients,
    /// the dual of a forward reduce-scatter), seconds.
    pub backward_comm_s: f64,
    /// Mesh axes over which the outputs come out of the local op as partial
    /// sums (sorted); the node reduces them in the forward.
    pub partial_axes: Vec<usize>,
    /// With partial axes: `None` all-reduces every output; `Some(d)`
    /// reduce-scatters the single output onto its dim `d` (the partial axes
    /// appended to that dim's axes).
    pub scatter_dim: Option<usize>,
    /// Per input: mesh axes over which its gradient comes out partial (the
    /// backward all-reduces it over them); empty when none or not needed.
    pub grad_reduce_axes: Vec<Vec<usize>>,
}
