//! One-step layout transforms and their alpha-beta costs.
//!
//! A step involves exactly one mesh axis `a` of size `n`; `b` is the local
//! byte size of the tensor before the step. Training runs each step forward
//! and its dual backward (the gradient of a tensor replicated along an axis is
//! the same on every replica, so the dual of an all-gather is a local split):
//!
//! | step                              | forward                      | backward               |
//! |-----------------------------------|------------------------------|------------------------|
//! | all-gather (drop last axis of d)  | all-gather, output `b*n`     | split (free)           |
//! | shard (append free axis to d)     | split (free)                 | all-gather, output `b` |
//! | all-to-all (last axis d1 -> d2)   | all-to-all of `b`            | all-to-all of `b`      |

use crate::error::{checked_product, invalid_argument, limit_exceeded, Result};
use crate::sharding::mesh::{ring_cost_s, Collective, DeviceMesh};
use crate::sharding::spec::{ShardingSpec, MAX_TENSOR_RANK};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepKind {
    AllGather,
    Shard,
    AllToAll,
}

impl StepKind {
    pub fn name(self) -> &'static str {
        match self {
            StepKind::AllGather => "all_gather",
            StepKind::Shard => "shard",
            StepKind::AllToAll => "all_to_all",
        }
    }
}

/// One transform: `dim` is the dim that loses (all-gather, all-to-all) or
/// gains (shard) the axis; `to_dim` is the dim that gains it in an all-to-all.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayoutStep {
    pub kind: StepKind,
    pub axis: usize,
    pub dim: usize,
    pub to_dim: Option<usize>,
    pub before: ShardingSpec,
    pub after: ShardingSpec,
    pub forward_cost_s: f64,
    pub backward_cost_s: f64,
}

impl LayoutStep {
    pub fn cost_s(&self) -> f64 {
        self.forward_cost_s + self.backward_cost_s
    }
}

/// A conversion from `src` to `dst`: the steps in order and their summed costs.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutPath {
    pub src: ShardingSpec,
    pub dst: ShardingSpec,
    pub steps: Vec<LayoutStep>,
    pub forward_cost_s: f64,
    pub backward_cost_s: f64,
}

impl LayoutPath {
    pub fn from_steps(src: ShardingSpec, dst: ShardingSpec, steps: Vec<LayoutStep>) -> LayoutPath {
        // Folded from +0.0: an empty f64 sum is -0.0, which prints as "-0".
        let forward_cost_s = steps.iter().fold(0.0, |t, s| t + s.forward_cost_s);
        let backward_cost_s = steps.iter().fold(0.0, |t, s| t + s.backward_cost_s);
        LayoutPath {
            src,
            dst,
            steps,
            forward_cost_s,
            backward_cost_s,
        }
    }

    /// Cost of a training step's worth of this conversion (forward + backward).
    pub fn cost_s(&self) -> f64 {
        self.forward_cost_s + self.backward_cost_s
    }
}

/// Everything a layout search needs: the mesh's link model and the tensor.
#[derive(Debug, Clone)]
pub struct LayoutProblem {
    pub(crate) mesh_shape: Vec<usize>,
    pub(crate) alpha_s: Vec<f64>,
    pub(crate) bandwidth_bytes_per_s: Vec<f64>,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype_bytes: usize,
    pub(crate) total_bytes: f64,
}

/// Largest element size in bytes (complex128).
pub const MAX_DTYPE_BYTES: usize = 16;

impl LayoutProblem {
    /// The conversions of a tensor of global `shape` with `dtype_bytes`-byte
    /// elements on `mesh`. Refuses a rank no spec can describe, an element size
    /// outside 1..=16 and a tensor whose byte count does not fit 64 bits.
    pub fn new(mesh: &DeviceMesh, shape: &[usize], dtype_bytes: usize) -> Result<LayoutProblem> {
        if shape.len() > MAX_TENSOR_RANK {
            return invalid_argument(format!(
                "shape {shape:?} has {} dims; a sharding spec describes at most {MAX_TENSOR_RANK}",
                shape.len()
            ));
        }
        if !(1..=MAX_DTYPE_BYTES).contains(&dtype_bytes) {
            return invalid_argument(format!(
                "dtype_bytes must be 1 to {MAX_DTYPE_BYTES} (bytes per element), got {dtype_bytes}"
            ));
        }
        let Some(total) = checked_product(shape.iter().copied().chain([dtype_bytes])) else {
            return limit_exceeded(format!(
                "a tensor of shape {shape:?} with {dtype_bytes}-byte elements holds more than \
                 2^64 bytes"
            ));
        };
        Ok(LayoutProblem {
            mesh_shape: mesh.shape().to_vec(),
            alpha_s: mesh.alpha_s().to_vec(),
            bandwidth_bytes_per_s: mesh.bandwidth_bytes_per_s().to_vec(),
            shape: shape.to_vec(),
            dtype_bytes,
            total_bytes: total as f64,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn dtype_bytes(&self) -> usize {
        self.dtype_bytes
    }

    /// Checks that a spec fits this problem's tensor and mesh.
    pub fn validate(&self, spec: &ShardingSpec) -> Result<()> {
        spec.validate_on(&self.shape, &self.mesh_shape)
    }

    #[inline]
    pub(crate) fn local_bytes(&self, spec: &ShardingSpec) -> f64 {
        self.total_bytes / spec.shard_count(&self.mesh_shape) as f64
    }

    #[inline]
    fn axis_cost_s(&self, kind: Collective, bytes: f64, axis: usize) -> f64 {
        ring_cost_s(
            kind,
            bytes,
            self.mesh_shape[axis],
            self.bandwidth_bytes_per_s[axis],
            self.alpha_s[axis],
        )
    }

    /// Local size of every dim under `spec`.
    fn local_dims(&self, spec: &ShardingSpec, out: &mut [usize]) {
        out[..self.shape.len()].copy_from_slice(&self.shape);
        for (a, &n) in self.mesh_shape.iter().enumerate() {
            if let Some(d) = spec.dim_of_axis(a) {
                out[d] /= n;
            }
        }
    }

    /// All valid one-step transforms of `spec`, appended to `out`.
    pub fn moves(&self, spec: &ShardingSpec, out: &mut Vec<LayoutStep>) {
        let rank = self.shape.len();
        let mut local = [0usize; MAX_TENSOR_RANK];
        self.local_dims(spec, &mut local);
        let b = self.local_bytes(spec);
        let used = spec.used_axes_mask();
        // All-gathers and all-to-alls move the last axis of a dim.
        for dim in 0..rank {
            let Some((gathered, axis)) = spec.without_last_axis(dim) else {
                continue;
            };
            let n = self.mesh_shape[axis];
            out.push(LayoutStep {
                kind: StepKind::AllGather,
                axis,
                dim,
                to_dim: None,
                before: *spec,
                after: gathered,
                forward_cost_s: self.axis_cost_s(Collective::AllGather, b * n as f64, axis),
                backward_cost_s: 0.0,
            });
            let a2a_s = self.axis_cost_s(Collective::AllToAll, b, axis);
            for to_dim in (0..rank).filter(|&t| t != dim && local[t] % n == 0) {
                out.push(LayoutStep {
                    kind: StepKind::AllToAll,
                    axis,
                    dim,
                    to_dim: Some(to_dim),
                    before: *spec,
                    after: gathered.with_axis_appended(to_dim, axis),
                    forward_cost_s: a2a_s,
                    backward_cost_s: a2a_s,
                });
            }
        }
        // Shards split a dim further by a free axis.
        for (axis, &n) in self.mesh_shape.iter().enumerate() {
            if used & (1 << axis) != 0 {
                continue;
            }
            let grad_gather_s = self.axis_cost_s(Collective::AllGather, b, axis);
            for dim in (0..rank).filter(|&d| local[d] % n == 0) {
                out.push(LayoutStep {
                    kind: StepKind::Shard,
                    axis,
                    dim,
                    to_dim: None,
                    before: *spec,
                    after: spec.with_axis_appended(dim, axis),
                    forward_cost_s: 0.0,
                    backward_cost_s: grad_gather_s,
                });
            }
        }
    }

    /// A lower bound on the cost of any path from `spec` to `target` (A*'s
    /// heuristic; admissible and consistent). Every step touches one axis; an
    /// axis whose placement differs from the target needs at least one step,
    /// and two (or one all-to-all, priced twice) if it must leave one place
    /// for another. No step costs less than `alpha + (n-1)/n * b_min / bw`.
    pub(crate) fn lower_bound_s(&self, spec: &ShardingSpec, target: &ShardingSpec) -> f64 {
        let b_min = self.total_bytes / self.mesh_shape.iter().product::<usize>() as f64;
        let mut bound = 0.0;
        for axis in 0..self.mesh_shape.len() {
            let here = spec.dim_of_axis(axis);
            let there = target.dim_of_axis(axis);
            let steps = match (here, there) {
                (None, None) => 0.0,
                (None, Some(_)) => 1.0,
                (Some(_), None) => 1.0,
                (Some(d), Some(t)) => {
                    if d == t && same_prefix_through(spec, target, d, axis) {
                        0.0
                    } else {
                        2.0
                    }
                }
            };
            if steps > 0.0 {
                bound += steps * self.axis_cost_s(Collective::AllGather, b_min, axis);
            }
        }
        bound
    }
}

/// Whether `axis` sits in `dim` behind the same axes in both specs.
fn same_prefix_through(a: &ShardingSpec, b: &ShardingSpec, dim: usize, axis: usize) -> bool {
    let (xa, xb) = (a.dim_axes(dim), b.dim_axes(dim));
    let pos = xa.as_slice().iter().position(|&x| x as usize == axis);
    match pos {
        Some(p) => xb.len() > p && xa.as_slice()[..=p] == xb.as_slice()[..=p],
        None => false,
    }
}
