//! Every valid sharding spec of a tensor on a mesh: each dim takes an ordered
//! sequence of distinct mesh axes whose sizes multiply to a divisor of it.
//! Axes of size 1 split nothing (a spec naming one holds the same data as the
//! spec without it), so they are left out.
//!
//! The count grows like (axes)! x C(axes + rank, rank): a 2-D tensor has
//! 634 889 specs on eight axes of size 2. Enumeration stops at
//! `MAX_ENUMERATED_SPECS` with a typed error instead of filling memory.

use crate::error::{invalid_argument, limit_exceeded, Result};
use crate::sharding::mesh::MAX_MESH_AXES;
use crate::sharding::spec::{ShardingSpec, MAX_TENSOR_RANK};

/// Most specs `enumerate_specs` returns (a cost matrix over them has the
/// square of this many entries).
pub const MAX_ENUMERATED_SPECS: usize = 100_000;

/// All valid specs of `shape` on a mesh of `mesh_shape`, replicated first.
pub fn enumerate_specs(shape: &[usize], mesh_shape: &[usize]) -> Result<Vec<ShardingSpec>> {
    let mut out = Vec::new();
    match walk_specs(shape, mesh_shape, MAX_ENUMERATED_SPECS, &mut |s| {
        out.push(s)
    }) {
        Ok(()) => Ok(out),
        Err(Stop::Limit) => too_many_specs(shape, mesh_shape, MAX_ENUMERATED_SPECS),
        Err(Stop::Invalid(e)) => Err(e),
    }
}

/// The number of valid specs, or None when it passes `limit` (counting stops there).
pub fn count_specs(shape: &[usize], mesh_shape: &[usize], limit: usize) -> Result<Option<usize>> {
    let mut n = 0usize;
    match walk_specs(shape, mesh_shape, limit, &mut |_| n += 1) {
        Ok(()) => Ok(Some(n)),
        Err(Stop::Limit) => Ok(None),
        Err(Stop::Invalid(e)) => Err(e),
    }
}

enum Stop {
    Limit,
    Invalid(crate::AutomapError),
}

/// Call `visit` on every valid spec, at most `limit` times (`Stop::Limit` past it).
fn walk_specs(
    shape: &[usize],
    mesh_shape: &[usize],
    limit: usize,
    visit: &mut dyn FnMut(ShardingSpec),
) -> std::result::Result<(), Stop> {
    check_inputs(shape, mesh_shape).map_err(Stop::Invalid)?;
    let mut walk = Walk {
        shape,
        mesh_shape,
        dims: vec![Vec::new(); shape.len()],
        left: limit,
        visit,
    };
    walk.fill_dim(0, 0)
}

fn check_inputs(shape: &[usize], mesh_shape: &[usize]) -> Result<()> {
    if shape.len() > MAX_TENSOR_RANK {
        return invalid_argument(format!(
            "shape {shape:?} has {} dims; a sharding spec describes at most {MAX_TENSOR_RANK}",
            shape.len()
        ));
    }
    if mesh_shape.len() > MAX_MESH_AXES || mesh_shape.contains(&0) {
        return invalid_argument(format!(
            "mesh shape {mesh_shape:?}: a mesh has 1 to {MAX_MESH_AXES} axes of size >= 1"
        ));
    }
    Ok(())
}

struct Walk<'a> {
    shape: &'a [usize],
    mesh_shape: &'a [usize],
    dims: Vec<Vec<usize>>,
    left: usize,
    visit: &'a mut dyn FnMut(ShardingSpec),
}

impl Walk<'_> {
    fn fill_dim(&mut self, dim: usize, used: u32) -> std::result::Result<(), Stop> {
        if dim == self.shape.len() {
            if self.left == 0 {
                return Err(Stop::Limit);
            }
            self.left -= 1;
            let spec = ShardingSpec::from_dims(&self.dims).map_err(Stop::Invalid)?;
            (self.visit)(spec);
            return Ok(());
        }
        // This dim's sequence so far is dims[dim]; first finish it as is, then extend.
        self.fill_dim(dim + 1, used)?;
        // parts divides shape[dim], so it fits a usize and so does parts * n
        // unless the mesh is absurd; such an axis cannot divide the dim anyway.
        let parts: usize = self.dims[dim].iter().map(|&a| self.mesh_shape[a]).product();
        for axis in 0..self.mesh_shape.len() {
            let n = self.mesh_shape[axis];
            let divides = parts
                .checked_mul(n)
                .is_some_and(|p| self.shape[dim].is_multiple_of(p));
            if n > 1 && used & (1 << axis) == 0 && divides {
                self.dims[dim].push(axis);
                self.fill_dim(dim, used | (1 << axis))?;
                self.dims[dim].pop();
            }
        }
        Ok(())
    }
}

/// The error of a tensor with more than `limit` specs.
pub(crate) fn too_many_specs<T>(shape: &[usize], mesh_shape: &[usize], limit: usize) -> Result<T> {
    limit_exceeded(format!(
        "a tensor of shape {shape:?} has more than {limit} sharding specs on a mesh of shape \
         {mesh_shape:?} (the cap); use a mesh with fewer axes of size > 1"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(shape: &[usize], mesh: &[usize]) -> Vec<ShardingSpec> {
        enumerate_specs(shape, mesh).unwrap()
    }

    #[test]
    fn counts_match_combinatorics() {
        // 3 axes over 4 divisible dims: sum_k C(3,k) k! C(k+3,3) = 1+12+60+120.
        assert_eq!(all(&[8, 8, 8, 8], &[2, 2, 2]).len(), 193);
        // Dims of size 2 hold at most one axis of size 2.
        assert_eq!(all(&[2, 2, 2, 2], &[2, 2, 2]).len(), 73);
        assert_eq!(all(&[6], &[3, 2]).len(), 5); // R S0 S1 S01 S10
        assert_eq!(all(&[], &[2]).len(), 1);
        assert_eq!(all(&[4, 4], &[1, 4]).len(), 3); // RR S1R RS1
        let specs = all(&[4, 6], &[2, 3]);
        let mut keys: Vec<_> = specs.iter().map(|s| s.key()).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), specs.len());
        assert_eq!(
            count_specs(&[8, 8, 8, 8], &[2, 2, 2], 1000).unwrap(),
            Some(193)
        );
        assert_eq!(count_specs(&[8, 8, 8, 8], &[2, 2, 2], 100).unwrap(), None);
    }

    #[test]
    fn too_many_specs_or_dims_are_typed_errors() {
        let e = enumerate_specs(&[64, 64], &[2; 8]).unwrap_err();
        assert!(matches!(e, crate::AutomapError::LimitExceeded(_)));
        assert!(e.to_string().contains("more than 100000"), "{e}");
        let e = enumerate_specs(&[2; 32], &[2]).unwrap_err();
        assert!(matches!(e, crate::AutomapError::InvalidArgument(_)));
        assert!(e.to_string().contains("32 dims"), "{e}");
    }
}
