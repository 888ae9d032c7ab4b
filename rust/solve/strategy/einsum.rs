//! The signature-driven strategy generator. A node is described by letters:
//! each dim of each operand carries a letter; equal letters are the same
//! index (`bk,nk->bn` is a linear layer). Each mesh axis goes to at most one
//! shardable letter (several axes to one letter in any order). Then:
//!
//! - every operand dim is split by the axes of its letter;
//! - the work is split by every assigned axis;
//! - axes on letters absent from the outputs (contracted) leave partial sums:
//!   the node all-reduces them, or reduce-scatters them onto an output dim;
//! - the gradient of an input is partial over the axes on letters that input
//!   lacks (the batch for a weight, the output features for an activation of
//!   a column-parallel layer): the backward all-reduces it. An additive input
//!   (a bias) lacks contracted letters without its gradient being partial.

use crate::error::{invalid_argument, limit_exceeded, Result};
use crate::sharding::collective::{collective_cost_s, Links};
use crate::sharding::mesh::Collective;
use crate::sharding::spec::{ShardingSpec, MAX_TENSOR_RANK};

use super::Strategy;

/// Most strategies one node may have: the assignments of mesh axes to letters
/// grow like (letters + axes)^axes, so an 8-axis mesh can yield millions.
pub const MAX_STRATEGIES: usize = 100_000;

/// A node in letter form. Letters are indices into `letter_sizes`.
#[derive(Debug, Clone)]
pub struct EinsumSignature {
    pub letter_sizes: Vec<usize>,
    /// Letters that must not be split (softmax dims, conv windows, size-1 dims...).
    pub unshardable: Vec<bool>,
    pub inputs: Vec<Vec<usize>>,
    pub outputs: Vec<Vec<usize>>,
    /// Full (unsharded) size of each input and output, bytes.
    pub input_bytes: Vec<f64>,
    pub output_bytes: Vec<f64>,
    /// Whether each input's gradient is needed (float tensors that require it).
    pub input_needs_grad: Vec<bool>,
    /// Inputs added to the result rather than multiplied into it (the bias of
    /// a linear or a convolution): their gradient sums the output gradient
    /// over the output letters they lack, never over contracted letters.
    pub input_additive: Vec<bool>,
    /// Forward + backward FLOPs of the whole node.
    pub flops: f64,
    /// The outputs are views of an input (a transpose, a slice): no bytes
    /// move, only the kernels' fixed cost is paid.
    pub is_view: bool,
}

/// Link model and device speed the costs are priced with.
#[derive(Debug, Clone)]
pub struct CostModel {
    pub mesh_shape: Vec<usize>,
    pub alpha_s: Vec<f64>,
    pub bandwidth_bytes_per_s: Vec<f64>,
    pub flops_per_s: f64,
    pub memory_bandwidth_bytes_per_s: f64,
    /// Fixed time of one kernel (dispatch and launch), seconds.
    pub op_overhead_s: f64,
    /// The backend runs a reduce-scatter as an all-reduce (gloo).
    pub reduce_scatter_as_all_reduce: bool,
}

impl CostModel {
    /// Roofline time of local work (`flops` and `bytes` read and written)
    /// plus the fixed cost of each of its `kernels`.
    pub fn work_s(&self, flops: f64, bytes: f64, kernels: f64) -> f64 {
        (flops / self.flops_per_s).max(bytes / self.memory_bandwidth_bytes_per_s)
            + kernels * self.op_overhead_s
    }

    /// One collective over a set of mesh axes, by the algorithm that will run it
    /// (one flat ring or per-axis steps, whichever is cheaper: `sharding::collective`).
    pub fn collective_s(&self, kind: Collective, bytes: f64, axes: &[usize]) -> f64 {
        let links = Links {
            shape: &self.mesh_shape,
            alpha_s: &self.alpha_s,
            bandwidth_bytes_per_s: &self.bandwidth_bytes_per_s,
            reduce_scatter_as_all_reduce: self.reduce_scatter_as_all_reduce,
        };
        collective_cost_s(kind, bytes, axes, &links)
    }
}

impl EinsumSignature {
    fn check(&self, cost: &CostModel) -> Result<()> {
        let n = self.letter_sizes.len();
        if self.unshardable.len() != n {
            return invalid_argument(format!(
                "unshardable has {} entries; it needs one per letter ({n})",
                self.unshardable.len()
            ));
        }
        if self.input_bytes.len() != self.inputs.len()
            || self.input_needs_grad.len() != self.inputs.len()
            || self.input_additive.len() != self.inputs.len()
            || self.output_bytes.len() != self.outputs.len()
        {
            return invalid_argument(
                "input_bytes, input_needs_grad and input_additive need one entry per input, \
                 output_bytes one per output",
            );
        }
        for operand in self.inputs.iter().chain(&self.outputs) {
            if let Some(&l) = operand.iter().find(|&&l| l >= n) {
                return invalid_argument(format!("letter {l} is out of range ({n} letters)"));
            }
            if operand.len() > MAX_TENSOR_RANK {
                return invalid_argument(format!(
                    "an operand has {} dims; a sharding spec describes at most {MAX_TENSOR_RANK}",
                    operand.len()
                ));
            }
        }
        let finite = |what: &str, x: f64| -> Result<()> {
            if x.is_finite() && x >= 0.0 {
                Ok(())
            } else {
                invalid_argument(format!("{what} must be finite and >= 0, got {x}"))
            }
        };
        finite("flops", self.flops)?;
        for &b in self.input_bytes.iter().chain(&self.output_bytes) {
            finite("operand bytes", b)?;
        }
        for (what, x) in [
            ("flops_per_s", cost.flops_per_s),
            (
                "memory_bandwidth_bytes_per_s",
                cost.memory_bandwidth_bytes_per_s,
            ),
        ] {
            if !(x.is_finite() && x > 0.0) {
                return invalid_argument(format!("{what} must be finite and > 0, got {x}"));
            }
        }
        finite("op_overhead_s", cost.op_overhead_s)?;
        let axes = cost.mesh_shape.len();
        if cost.alpha_s.len() != axes
            || cost.bandwidth_bytes_per_s.len() != axes
            || cost.mesh_shape.contains(&0)
        {
            return invalid_argument("the cost model needs a valid mesh");
        }
        Ok(())
    }

    /// Letters that appear in no output.
    fn contracted(&self) -> Vec<bool> {
        let mut c = vec![true; self.letter_sizes.len()];
        for out in &self.outputs {
            for &l in out {
                c[l] = false;
            }
        }
        c
    }

    /// A letter that appears twice in one operand (a diagonal) cannot be split.
    fn splittable(&self) -> Vec<bool> {
        let mut ok: Vec<bool> = self.unshardable.iter().map(|u| !u).collect();
        for operand in self.inputs.iter().chain(&self.outputs) {
            for (i, &l) in operand.iter().enumerate() {
                if operand[..i].contains(&l) {
                    ok[l] = false;
                }
            }
        }
        ok
    }
}

/// Every valid strategy of `sig` on the cost model's mesh (at most `MAX_STRATEGIES`).
pub fn einsum_strategies(sig: &EinsumSignature, cost: &CostModel) -> Result<Vec<Strategy>> {
    sig.check(cost)?;
    let splittable = sig.splittable();
    let contracted = sig.contracted();
    // Axes of size 1 split nothing: leave them out so strategies are distinct.
    let axes: Vec<usize> = (0..cost.mesh_shape.len())
        .filter(|&a| cost.mesh_shape[a] > 1)
        .collect();
    let walk = Walk {
        sig,
        cost,
        splittable: &splittable,
        contracted: &contracted,
        axes: &axes,
    };
    let mut per_letter: Vec<Vec<usize>> = vec![Vec::new(); sig.letter_sizes.len()];
    let mut out = Vec::new();
    walk.assign(0, &mut per_letter, &mut out)?;
    Ok(out)
}

/// What stays fixed while axes are handed out to letters.
struct Walk<'a> {
    sig: &'a EinsumSignature,
    cost: &'a CostModel,
    splittable: &'a [bool],
    contracted: &'a [bool],
    axes: &'a [usize],
}

impl Walk<'_> {
    /// Give axis `next` (and recursively the rest) to no letter or to a letter,
    /// at any position among the axes the letter already has; price each result.
    fn assign(
        &self,
        next: usize,
        per_letter: &mut Vec<Vec<usize>>,
        out: &mut Vec<Strategy>,
    ) -> Result<()> {
        if next == self.axes.len() {
            if out.len() >= MAX_STRATEGIES {
                return limit_exceeded(format!(
                    "a node has more than {MAX_STRATEGIES} sharding strategies on a mesh of \
                     shape {:?} (the cap); use a mesh with fewer axes of size > 1",
                    self.cost.mesh_shape
                ));
            }
            return price(self.sig, self.cost, self.contracted, per_letter, out);
        }
        let axis = self.axes[next];
        let n = self.cost.mesh_shape[axis];
        self.assign(next + 1, per_letter, out)?;
        for l in 0..self.sig.letter_sizes.len() {
            // A product past usize divides no letter size.
            let parts = per_letter[l]
                .iter()
                .try_fold(n, |acc, &a| acc.checked_mul(self.cost.mesh_shape[a]));
            let divides = parts.is_some_and(|p| self.sig.letter_sizes[l].is_multiple_of(p));
            if !self.splittable[l] || !divides {
                continue;
            }
            for pos in 0..=per_letter[l].len() {
                per_letter[l].insert(pos, axis);
                self.assign(next + 1, per_letter, out)?;
                per_letter[l].remove(pos);
            }
        }
        Ok(())
    }
}

/// The spec of an operand; an axis sits on one letter, but a letter that
/// appears twice in one operand (a diagonal) would name it twice: those
/// letters are never split (`splittable`), and `from_dims` says so if one is.
fn spec_of(operand: &[usize], per_letter: &[Vec<usize>]) -> Result<ShardingSpec> {
    let dims: Vec<&[usize]> = operand.iter().map(|&l| per_letter[l].as_slice()).collect();
    ShardingSpec::from_dims(&dims)
}

fn shard_count(operand: &[usize], per_letter: &[Vec<usize>], mesh_shape: &[usize]) -> f64 {
    operand
        .iter()
        .flat_map(|&l| &per_letter[l])
        .map(|&a| mesh_shape[a] as f64)
        .product()
}

/// The node's local forward and backward work: its share of the FLOPs, and
/// the local bytes it reads and writes. The forward reads the inputs and
/// writes the outputs (one kernel); the backward, when any input needs a
/// gradient, reads the output gradient and the inputs and writes one gradient
/// per such input (a kernel each). A view moves no bytes.
fn local_work_s(
    sig: &EinsumSignature,
    cost: &CostModel,
    per_letter: &[Vec<usize>],
    all_assigned: f64,
    output_local: &[f64],
) -> f64 {
    let mesh = &cost.mesh_shape;
    let input_local: Vec<f64> = sig
        .inputs
        .iter()
        .zip(&sig.input_bytes)
        .map(|(op, &b)| b / shard_count(op, per_letter, mesh))
        .collect();
    let forward_bytes: f64 = input_local.iter().sum::<f64>() + output_local.iter().sum::<f64>();
    let grads: Vec<f64> = input_local
        .iter()
        .zip(&sig.input_needs_grad)
        .filter(|(_, &g)| g)
        .map(|(&b, _)| b)
        .collect();
    let (bytes, kernels) = if grads.is_empty() {
        (forward_bytes, 1.0)
    } else {
        (
            2.0 * forward_bytes + grads.iter().sum::<f64>(),
            1.0 + grads.len() as f64,
        )
    };
    let bytes = if sig.is_view { 0.0 } else { bytes };
    cost.work_s(sig.flops / all_assigned, bytes, kernels)
}

fn price(
    sig: &EinsumSignature,
    cost: &CostModel,
    contracted: &[bool],
    per_letter: &[Vec<usize>],
    out: &mut Vec<Strategy>,
) -> Result<()> {
    let mesh = &cost.mesh_shape;
    let all_assigned: f64 = per_letter
        .iter()
        .flatten()
        .map(|&a| mesh[a] as f64)
        .product();
    let partial: Vec<usize> = {
        let mut p: Vec<usize> = (0..per_letter.len())
            .filter(|&l| contracted[l])
            .flat_map(|l| per_letter[l].clone())
            .collect();
        p.sort_unstable();
        p
    };
    let inputs: Vec<ShardingSpec> = sig
        .inputs
        .iter()
        .map(|op| spec_of(op, per_letter))
        .collect::<Result<_>>()?;
    let outputs: Vec<ShardingSpec> = sig
        .outputs
        .iter()
        .map(|op| spec_of(op, per_letter))
        .collect::<Result<_>>()?;
    // Input gradients partial over the axes of letters the input lacks.
    let mut backward_comm_s = 0.0;
    let mut grad_reduce_axes = Vec::with_capacity(sig.inputs.len());
    for (i, operand) in sig.inputs.iter().enumerate() {
        let mut lacking: Vec<usize> = Vec::new();
        if sig.input_needs_grad[i] {
            let additive = sig.input_additive[i];
            lacking = (0..per_letter.len())
                .filter(|&l| !operand.contains(&l) && (!additive || !contracted[l]))
                .flat_map(|l| per_letter[l].iter().copied())
                .collect();
            lacking.sort_unstable();
        }
        if !lacking.is_empty() {
            let local = sig.input_bytes[i] / shard_count(operand, per_letter, mesh);
            backward_comm_s += cost.collective_s(Collective::AllReduce, local, &lacking);
        }
        grad_reduce_axes.push(lacking);
    }
    let output_local: Vec<f64> = sig
        .outputs
        .iter()
        .zip(&sig.output_bytes)
        .map(|(op, &b)| b / shard_count(op, per_letter, mesh))
        .collect();
    let compute_s = local_work_s(sig, cost, per_letter, all_assigned, &output_local);
    // Partial sums made whole by an all-reduce: outputs as assigned.
    let all_reduce_s: f64 = output_local
        .iter()
        .map(|&b| cost.collective_s(Collective::AllReduce, b, &partial))
        .sum();
    out.push(Strategy {
        inputs: inputs.clone(),
        outputs: outputs.clone(),
        compute_s,
        forward_comm_s: all_reduce_s,
        backward_comm_s,
        partial_axes: partial.clone(),
        scatter_dim: None,
        grad_reduce_axes: grad_reduce_axes.clone(),
    });
    // Or reduce-scattered onto one dim of a single output (its dual, an
    // all-gather of the output gradient, runs in the backward).
    let [out_op] = sig.outputs.as_slice() else {
        return Ok(());
    };
    if partial.is_empty() {
        return Ok(());
    }
    let scatter = cost.collective_s(Collective::ReduceScatter, output_local[0], &partial);
    let gather_grad = cost.collective_s(Collective::AllGather, output_local[0], &partial);
    let extra: usize = partial.iter().map(|&a| mesh[a]).product();
    for (d, &l) in out_op.iter().enumerate() {
        if sig.unshardable[l] || out_op[..d].contains(&l) {
            continue;
        }
        let parts = per_letter[l]
            .iter()
            .try_fold(extra, |acc, &a| acc.checked_mul(mesh[a]));
        if !parts.is_some_and(|p| sig.letter_sizes[l].is_multiple_of(p)) {
            continue;
        }
        let mut dims: Vec<Vec<usize>> = out_op.iter().map(|&x| per_letter[x].clone()).collect();
        dims[d].extend(&partial);
        // The partial axes sit on contracted letters, so they are free in the output.
        let scattered = ShardingSpec::from_dims(&dims)?;
        // An additive input (a bias) joins after the reduce-scatter: where it
        // lacks the scattered letter, its gradient sums a split output gradient.
        let mut grads = grad_reduce_axes.clone();
        let mut bias_grad_s = 0.0;
        for (i, operand) in sig.inputs.iter().enumerate() {
            if sig.input_additive[i] && sig.input_needs_grad[i] && !operand.contains(&l) {
                grads[i].extend(&partial);
                grads[i].sort_unstable();
                let local = sig.input_bytes[i] / shard_count(operand, per_letter, mesh);
                bias_grad_s += cost.collective_s(Collective::AllReduce, local, &partial);
            }
        }
        out.push(Strategy {
            inputs: inputs.clone(),
            outputs: vec![scattered],
            compute_s,
            forward_comm_s: scatter,
            backward_comm_s: backward_comm_s + gather_grad + bias_grad_s,
            partial_axes: partial.clone(),
            scatter_dim: Some(d),
            grad_reduce_axes: grads,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(mesh: &[usize]) -> CostModel {
        CostModel {
            mesh_shape: mesh.to_vec(),
            alpha_s: vec![1e-5; mesh.len()],
            bandwidth_bytes_per_s: vec![1e9; mesh.len()],
            flops_per_s: 1e12,
            memory_bandwidth_bytes_per_s: 1e11,
            reduce_scatter_as_all_reduce: false,
            op_overhead_s: 1e-6,
        }
    }

    /// y[b,n] = x[b,k] w[n,k] (a linear layer without bias).
    fn linear(b: usize, k: usize, n: usize) -> EinsumSignature {
        EinsumSignature {
            letter_sizes: vec![b, k, n],
            unshardable: vec![false; 3],
            inputs: vec![vec![0, 1], vec![2, 1]],
            outputs: vec![vec![0, 2]],
            input_bytes: vec![(b * k * 4) as f64, (n * k * 4) as f64],
            output_bytes: vec![(b * n * 4) as f64],
            input_needs_grad: vec![true, true],
            input_additive: vec![false, false],
            flops: (6 * b * k * n) as f64,
            is_view: false,
        }
    }

    fn find<'a>(s: &'a [Strategy], x: &str, w: &str, y: &str) -> Vec<&'a Strategy> {
        s.iter()
            .filter(|st| {
                st.inputs[0].to_string() == x
                    && st.inputs[1].to_string() == w
                    && st.outputs[0].to_string() == y
            })
            .collect()
    }

    #[test]
    fn linear_on_a_line_has_dp_column_row_and_replicated() {
        let c = cost(&[4]);
        let s = einsum_strategies(&linear(8, 16, 32), &c).unwrap();
        // none, b, k (all-reduce + reduce-scatter onto b and n), n.
        assert_eq!(s.len(), 1 + 1 + 3 + 1);
        let dp = find(&s, "S0R", "RR", "S0R")[0];
        // Weight gradient partial over the batch axis: all-reduce of the full weight.
        assert!(
            (dp.backward_comm_s - c.collective_s(Collective::AllReduce, 16.0 * 32.0 * 4.0, &[0]))
                .abs()
                < 1e-15
        );
        assert_eq!(dp.forward_comm_s, 0.0);
        let column = find(&s, "RR", "S0R", "RS0")[0];
        // Input gradient partial over the output features (Megatron's f).
        assert!(
            (column.backward_comm_s
                - c.collective_s(Collective::AllReduce, 8.0 * 16.0 * 4.0, &[0]))
            .abs()
                < 1e-15
        );
        let row = find(&s, "RS0", "RS0", "RR")[0];
        // Output partial over the contraction (Megatron's g).
        assert!(
            (row.forward_comm_s - c.collective_s(Collective::AllReduce, 8.0 * 32.0 * 4.0, &[0]))
                .abs()
                < 1e-15
        );
        assert_eq!(row.backward_comm_s, 0.0);
        assert_eq!(find(&s, "RS0", "RS0", "S0R").len(), 1); // reduce-scatter onto b
                                                            // Local work: a quarter of the FLOPs; x and w shards, the whole (partial)
                                                            // output; three kernels (forward, input and weight gradients).
        let (x, w, y) = (8.0 * 16.0, 32.0 * 16.0, 8.0 * 32.0 * 4.0);
        let bytes = 2.0 * (x + w + y) + (x + w);
        let flops = 6.0 * 8.0 * 16.0 * 32.0 / 4.0;
        assert_eq!(row.compute_s, c.work_s(flops, bytes, 3.0));
        // This small layer is memory-bound: bytes over bandwidth, plus overheads.
        assert!((row.compute_s - (bytes / 1e11 + 3e-6)).abs() < 1e-18);
    }

    #[test]
    fn compute_bound_work_is_flops_over_rate() {
        let mut c = cost(&[4]);
        c.memory_bandwidth_bytes_per_s = 1e15;
        let s = einsum_strategies(&linear(8, 16, 32), &c).unwrap();
        let row = find(&s, "RS0", "RS0", "RR")[0];
        let rep = find(&s, "RR", "RR", "RR")[0];
        let flops = 6.0 * 8.0 * 16.0 * 32.0;
        assert!((rep.compute_s - (flops / 1e12 + 3e-6)).abs() < 1e-15);
        assert!((row.compute_s - (flops / 4.0 / 1e12 + 3e-6)).abs() < 1e-15);
    }

    /// y = f(x) elementwise on [b, n], no FLOPs counted (a GELU, a dropout).
    fn unary(b: usize, n: usize, needs_grad: bool) -> EinsumSignature {
        let bytes = (b * n * 4) as f64;
        EinsumSignature {
            letter_sizes: vec![b, n],
            unshardable: vec![false; 2],
            inputs: vec![vec![0, 1]],
            outputs: vec![vec![0, 1]],
            input_bytes: vec![bytes],
            output_bytes: vec![bytes],
            input_needs_grad: vec![needs_grad],
            input_additive: vec![false],
            flops: 0.0,
            is_view: false,
        }
    }

    #[test]
    fn elementwise_work_is_bytes_over_bandwidth_plus_overhead() {
        let c = cost(&[4]);
        let full = 64.0 * 256.0 * 4.0;
        let s = einsum_strategies(&unary(64, 256, true), &c).unwrap();
        let split = s
            .iter()
            .find(|st| st.outputs[0].to_string() == "S0R")
            .unwrap();
        // Forward: read x, write y; backward: read dy and x, write dx.
        let local = full / 4.0;
        let expected = 5.0 * local / 1e11 + 2.0 * 1e-6;
        assert!((split.compute_s - expected).abs() < 1e-18);
        let whole = s
            .iter()
            .find(|st| st.outputs[0].to_string() == "RR")
            .unwrap();
        assert!((whole.compute_s - (5.0 * full / 1e11 + 2e-6)).abs() < 1e-18);
        // Without a gradient, only the forward kernel runs.
        let s = einsum_strategies(&unary(64, 256, false), &c).unwrap();
        let whole = s
            .iter()
            .find(|st| st.outputs[0].to_string() == "RR")
            .unwrap();
        assert!((whole.compute_s - (2.0 * full / 1e11 + 1e-6)).abs() < 1e-18);
    }

    #[test]
    fn two_d_mesh_counts_and_divisibility() {
        let c = cost(&[2, 2]);
        let s = einsum_strategies(&linear(8, 16, 32), &c).unwrap();
        // Assignments of two axes to none/b/k/n, with order on a shared letter:
        // 1 + 3 + 3 (one axis) + 6 (distinct letters) + 6 (same letter) = 19;
        // the 8 with an axis on k also reduce-scatter onto b or onto n: +16.
        assert_eq!(s.len(), 35);
        // b of size 2 cannot take both axes.
        let s = einsum_strategies(&linear(2, 16, 32), &c).unwrap();
        assert!(s.iter().all(|st| st.inputs[0].to_string() != "S01R"));
        assert!(s.iter().all(|st| st.inputs[0].to_string() != "S10R"));
    }

    #[test]
    fn bias_gradient_is_whole_under_a_split_contraction() {
        let c = cost(&[4]);
        let mut sig = linear(8, 16, 32);
        sig.inputs.push(vec![2]);
        sig.input_bytes.push(32.0 * 4.0);
        sig.input_needs_grad.push(true);
        sig.input_additive.push(true);
        let s = einsum_strategies(&sig, &c).unwrap();
        let row = s
            .iter()
            .find(|st| st.inputs[1].to_string() == "RS0" && st.scatter_dim.is_none())
            .unwrap();
        assert_eq!(row.grad_reduce_axes, vec![Vec::<usize>::new(); 3]);
        // Reduce-scattered onto the batch: the bias lacks it, its gradient is partial.
        let onto_batch = s
            .iter()
            .find(|st| st.inputs[1].to_string() == "RS0" && st.scatter_dim == Some(0))
            .unwrap();
        assert_eq!(onto_batch.grad_reduce_axes, vec![vec![], vec![], vec![0]]);
        let onto_features = s
            .iter()
            .find(|st| st.inputs[1].to_string() == "RS0" && st.scatter_dim == Some(1))
            .unwrap();
        assert_eq!(onto_features.grad_reduce_axes, vec![Vec::<usize>::new(); 3]);
        let dp = s
            .iter()
            .find(|st| st.inputs[0].to_string() == "S0R")
            .unwrap();
        assert_eq!(dp.grad_reduce_axes, vec![vec![], vec![0], vec![0]]);
    }

    #[test]
    fn unshardable_and_diagonal_letters_stay_whole() {
        let c = cost(&[4]);
        let mut sig = linear(8, 16, 32);
        sig.unshardable[1] = true; // k
        let s = einsum_strategies(&sig, &c).unwrap();
        assert!(s.iter().all(|st| st.inputs[1].to_string() != "RS0"));
        assert_eq!(s.len(), 3);
    }
}
