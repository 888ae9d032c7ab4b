//! Every valid sharding spec of a tensor on a mesh: each dim takes an ordered
//! sequence of distinct mesh axes whose sizes multiply to a divisor of it.
//! Axes of size 1 split nothing (a spec naming one holds the same data as the
//! spec without it), so they are left out.

use crate::sharding::spec::ShardingSpec;

/// All valid specs of `shape` on a mesh of `mesh_shape`, replicated first.
pub fn enumerate_specs(shape: &[usize], mesh_shape: &[usize]) -> Vec<ShardingSpec> {
    let mut out = Vec::new();
    let mut dims: Vec<Vec<usize>> = vec![Vec::new(); shape.len()];
    fill_dim(0, 0, shape, mesh_shape, &mut dims, &mut out);
    out
}

fn fill_dim(
    dim: usize,
    used: u32,
    shape: &[usize],
    mesh_shape: &[usize],
    dims: &mut Vec<Vec<usize>>,
    out: &mut Vec<ShardingSpec>,
) {
    if dim == shape.len() {
        out.push(ShardingSpec::from_dims(dims).expect("axes are distinct and in range"));
        return;
    }
    // This dim's sequence so far is dims[dim]; first finish it as is, then extend.
    fill_dim(dim + 1, used, shape, mesh_shape, dims, out);
    let parts: usize = dims[dim].iter().map(|&a| mesh_shape[a]).product();
    for (axis, &n) in mesh_shape.iter().enumerate() {
        if n > 1 && used & (1 << axis) == 0 && shape[dim].is_multiple_of(parts * n) {
            dims[dim].push(axis);
            fill_dim(dim, used | (1 << axis), shape, mesh_shape, dims, out);
            dims[dim].pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_match_combinatorics() {
        // 3 axes over 4 divisible dims: sum_k C(3,k) k! C(k+3,3) = 1+12+60+120.
        assert_eq!(enumerate_specs(&[8, 8, 8, 8], &[2, 2, 2]).len(), 193);
        // Dims of size 2 hold at most one axis of size 2.
        assert_eq!(enumerate_specs(&[2, 2, 2, 2], &[2, 2, 2]).len(), 73);
        assert_eq!(enumerate_specs(&[6], &[3, 2]).len(), 5); // R S0 S1 S01 S10
        assert_eq!(enumerate_specs(&[], &[2]).len(), 1);
        assert_eq!(enumerate_specs(&[4, 4], &[1, 4]).len(), 3); // RR S1R RS1
        let specs = enumerate_specs(&[4, 6], &[2, 3]);
        let mut keys: Vec<_> = specs.iter().map(|s| s.key()).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), specs.len());
    }
}
