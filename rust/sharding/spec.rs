//! Sharding specs in the MAP paper's notation: one entry per tensor dim, `R`
//! (replicated) or `S` followed by the ordered mesh axes that split it
//! (`S01`: split over axis 0, then each part over axis 1). Canonical string:
//! the entries concatenated, e.g. `S0R`, `RS01`, `S1S0R`; a scalar is ``.

use std::fmt;

use crate::error::{checked_product, invalid_spec, Result};
use crate::sharding::mesh::{DeviceMesh, MAX_MESH_AXES};

/// Highest tensor rank a spec can describe (a slot packs the dim in 5 bits).
pub const MAX_TENSOR_RANK: usize = 31;

const UNUSED: u8 = 0xFF;

/// Mesh axes in order, as a small inline list.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct AxisList {
    len: u8,
    axes: [u8; MAX_MESH_AXES],
}

impl AxisList {
    pub fn as_slice(&self) -> &[u8] {
        &self.axes[..self.len as usize]
    }
    pub fn len(&self) -> usize {
        self.len as usize
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn last(&self) -> Option<usize> {
        self.as_slice().last().map(|&a| a as usize)
    }
}

/// A sharding spec, packed: for each mesh axis the (dim, position) it splits,
/// or nothing. Positions within a dim are dense from 0, so equal layouts have
/// equal bits and `key()` is a canonical 64-bit identity (given the rank).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardingSpec {
    rank: u8,
    slots: [u8; MAX_MESH_AXES],
}

impl ShardingSpec {
    /// The fully replicated spec of a tensor of `rank` dims.
    pub fn replicated(rank: usize) -> Result<ShardingSpec> {
        if rank > MAX_TENSOR_RANK {
            return invalid_spec(format!(
                "tensors of rank {rank} are not supported (at most {MAX_TENSOR_RANK})"
            ));
        }
        Ok(ShardingSpec {
            rank: rank as u8,
            slots: [UNUSED; MAX_MESH_AXES],
        })
    }

    /// From the mesh axes of each dim, e.g. `[[0, 1], []]` for `S01R`.
    pub fn from_dims<A: AsRef<[usize]>>(dims: &[A]) -> Result<ShardingSpec> {
        let mut spec = ShardingSpec::replicated(dims.len())?;
        for (d, axes) in dims.iter().enumerate() {
            for (pos, &a) in axes.as_ref().iter().enumerate() {
                if a >= MAX_MESH_AXES {
                    return invalid_spec(format!(
                        "dim {d} names mesh axis {a}; a mesh has at most {MAX_MESH_AXES} axes"
                    ));
                }
                if spec.slots[a] != UNUSED {
                    return invalid_spec(format!(
                        "mesh axis {a} is used twice in {:?} (dims {} and {d})",
                        dims.iter().map(|x| x.as_ref().to_vec()).collect::<Vec<_>>(),
                        spec.slots[a] >> 3
                    ));
                }
                spec.slots[a] = ((d as u8) << 3) | pos as u8;
            }
        }
        Ok(spec)
    }

    /// Parse the canonical string form (`S01R`, `RS1S0`, `R`; `` for a scalar).
    pub fn parse(text: &str) -> Result<ShardingSpec> {
        let bytes = text.as_bytes();
        let mut dims: Vec<Vec<usize>> = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'R' => {
                    dims.push(Vec::new());
                    i += 1;
                }
                b'S' => {
                    i += 1;
                    let start = i;
                    let mut axes = Vec::new();
                    while i < bytes.len() && bytes[i].is_ascii_digit() {
                        axes.push((bytes[i] - b'0') as usize);
                        i += 1;
                    }
                    if i == start {
                        return invalid_spec(format!(
                            "bad sharding spec {text:?}: 'S' at position {} must be followed by \
                             mesh axis digits, e.g. S0 or S01",
                            start - 1
                        ));
                    }
                    dims.push(axes);
                }
                other => {
                    return invalid_spec(format!(
                        "bad sharding spec {text:?}: unexpected {:?} at position {i}; a spec is a \
                         sequence of R and S<axes>, e.g. S0R or RS01",
                        other as char
                    ))
                }
            }
        }
        ShardingSpec::from_dims(&dims)
    }

    pub fn rank(&self) -> usize {
        self.rank as usize
    }

    /// Canonical identity for hashing (together with the rank).
    #[inline]
    pub fn key(&self) -> u64 {
        u64::from_le_bytes(self.slots)
    }

    /// The tensor dim that mesh axis `axis` splits, if any.
    #[inline]
    pub fn dim_of_axis(&self, axis: usize) -> Option<usize> {
        let s = self.slots[axis];
        (s != UNUSED).then_some((s >> 3) as usize)
    }

    /// The ordered mesh axes that split `dim`.
    pub fn dim_axes(&self, dim: usize) -> AxisList {
        let mut out = AxisList::default();
        for (a, &s) in self.slots.iter().enumerate() {
            if s != UNUSED && (s >> 3) as usize == dim {
                out.axes[(s & 7) as usize] = a as u8;
                out.len += 1;
            }
        }
        out
    }

    /// Mesh axes used by this spec, as a bit set.
    #[inline]
    pub fn used_axes_mask(&self) -> u32 {
        let mut m = 0;
        for (a, &s) in self.slots.iter().enumerate() {
            if s != UNUSED {
                m |= 1 << a;
            }
        }
        m
    }

    pub fn is_replicated(&self) -> bool {
        self.slots == [UNUSED; MAX_MESH_AXES]
    }

    /// Highest mesh axis the spec names, plus one.
    fn axes_needed(&self) -> usize {
        32 - self.used_axes_mask().leading_zeros() as usize
    }

    /// Checks the spec against a global shape and a mesh: rank, axes in range,
    /// every split dim divisible by the product of its axes.
    pub fn validate(&self, shape: &[usize], mesh: &DeviceMesh) -> Result<()> {
        self.validate_on(shape, mesh.shape())
    }

    /// `validate` against a mesh given by its shape only.
    pub fn validate_on(&self, shape: &[usize], mesh_shape: &[usize]) -> Result<()> {
        if shape.len() != self.rank() {
            return invalid_spec(format!(
                "spec {self} has {} dims but the tensor has shape {shape:?} ({} dims)",
                self.rank(),
                shape.len()
            ));
        }
        if self.axes_needed() > mesh_shape.len() {
            return invalid_spec(format!(
                "spec {self} names mesh axis {} but the mesh {:?} has {} axes",
                self.axes_needed() - 1,
                mesh_shape,
                mesh_shape.len()
            ));
        }
        for (d, &size) in shape.iter().enumerate() {
            let axes = self.dim_axes(d);
            let parts = checked_product(axes.as_slice().iter().map(|&a| mesh_shape[a as usize]));
            if !parts.is_some_and(|p| p > 0 && size.is_multiple_of(p)) {
                let parts = parts.map_or("too many".to_string(), |p| p.to_string());
                return invalid_spec(format!(
                    "spec {self}: dim {d} of size {size} cannot be split into {parts} parts over \
                     mesh axes {:?} of sizes {:?}",
                    axes.as_slice(),
                    axes.as_slice()
                        .iter()
                        .map(|&a| mesh_shape[a as usize])
                        .collect::<Vec<_>>()
                ));
            }
        }
        Ok(())
    }

    /// `shard_count` after checking that the mesh has every axis the spec names.
    pub fn checked_shard_count(&self, mesh_shape: &[usize]) -> Result<usize> {
        if self.axes_needed() > mesh_shape.len() {
            return invalid_spec(format!(
                "spec {self} names mesh axis {} but the mesh {mesh_shape:?} has {} axes",
                self.axes_needed() - 1,
                mesh_shape.len()
            ));
        }
        Ok(self.shard_count(mesh_shape))
    }

    /// Number of parts the tensor is split into (devices holding distinct
    /// data); the mesh must have every axis the spec names.
    #[inline]
    pub fn shard_count(&self, mesh_shape: &[usize]) -> usize {
        let mut n = 1;
        for (a, &s) in self.slots.iter().enumerate() {
            if s != UNUSED {
                n *= mesh_shape[a];
            }
        }
        n
    }

    /// Shape of the shard each device holds (the spec must be valid for `shape`).
    pub fn local_shape(&self, shape: &[usize], mesh: &DeviceMesh) -> Result<Vec<usize>> {
        self.validate(shape, mesh)?;
        let mut local = shape.to_vec();
        for (a, &s) in self.slots.iter().enumerate() {
            if s != UNUSED {
                local[(s >> 3) as usize] /= mesh.shape()[a];
            }
        }
        Ok(local)
    }

    /// The `[start, stop)` range of every dim that the device at `rank` holds.
    pub fn local_slices(
        &self,
        shape: &[usize],
        mesh: &DeviceMesh,
        rank: i64,
    ) -> Result<Vec<(usize, usize)>> {
        let local = self.local_shape(shape, mesh)?;
        let coord = mesh.coordinate(rank)?;
        Ok((0..self.rank())
            .map(|d| {
                let index = self.dim_axes(d).as_slice().iter().fold(0, |acc, &a| {
                    acc * mesh.shape()[a as usize] + coord[a as usize]
                });
                (index * local[d], (index + 1) * local[d])
            })
            .collect())
    }

    // One-step transforms (the layout manager's moves). Each returns the spec
    // after the move; divisibility is the caller's business.

    /// All-gather: drop the last (innermost) axis of `dim`.
    pub(crate) fn without_last_axis(&self, dim: usize) -> Option<(ShardingSpec, usize)> {
        let axis = self.dim_axes(dim).last()?;
        let mut out = *self;
        out.slots[axis] = UNUSED;
        Some((out, axis))
    }

    /// Shard: split `dim` further by the free mesh axis `axis` (as innermost).
    pub(crate) fn with_axis_appended(&self, dim: usize, axis: usize) -> ShardingSpec {
        debug_assert_eq!(self.slots[axis], UNUSED);
        let pos = self.dim_axes(dim).len();
        let mut out = *self;
        out.slots[axis] = ((dim as u8) << 3) | pos as u8;
        out
    }
}

impl fmt::Display for ShardingSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in 0..self.rank() {
            let axes = self.dim_axes(d);
            if axes.is_empty() {
                f.write_str("R")?;
            } else {
                f.write_str("S")?;
                for &a in axes.as_slice() {
                    write!(f, "{a}")?;
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for ShardingSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ShardingSpec({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn mesh(shape: &[usize]) -> DeviceMesh {
        DeviceMesh::uniform(shape.to_vec(), 0.0, 1.0).unwrap()
    }

    #[test]
    fn parse_and_format_round_trip() {
        for s in ["S0R", "RS01", "S1S0R", "R", "RR", "S01R", "", "S2RS10"] {
            assert_eq!(ShardingSpec::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(
            ShardingSpec::parse("S0R").unwrap().dim_axes(0).as_slice(),
            &[0]
        );
        assert_eq!(
            ShardingSpec::parse("RS10").unwrap().dim_axes(1).as_slice(),
            &[1, 0]
        );
    }

    #[test]
    fn parse_errors_name_the_problem() {
        let e = ShardingSpec::parse("S0S0").unwrap_err().to_string();
        assert!(e.contains("axis 0 is used twice"), "{e}");
        let e = ShardingSpec::parse("SR").unwrap_err().to_string();
        assert!(e.contains("must be followed by"), "{e}");
        let e = ShardingSpec::parse("S0X").unwrap_err().to_string();
        assert!(e.contains("'X'"), "{e}");
        assert!(ShardingSpec::parse("S9").is_err());
    }

    #[test]
    fn validation_names_dim_and_sizes() {
        let m = mesh(&[2, 3]);
        let spec = ShardingSpec::parse("S01R").unwrap();
        assert!(spec.validate(&[12, 5], &m).is_ok());
        let e = spec.validate(&[8, 5], &m).unwrap_err().to_string();
        assert!(
            e.contains("dim 0 of size 8") && e.contains("6 parts"),
            "{e}"
        );
        let e = ShardingSpec::parse("S2R")
            .unwrap()
            .validate(&[4, 4], &m)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mesh axis 2"), "{e}");
        let e = spec.validate(&[12], &m).unwrap_err().to_string();
        assert!(e.contains("2 dims"), "{e}");
    }

    #[test]
    fn local_shape_and_slices() {
        let m = DeviceMesh::new(
            vec![2, 2],
            Some(vec![3, 2, 1, 0]),
            vec![0.0; 2],
            vec![1.0; 2],
        )
        .unwrap();
        let spec = ShardingSpec::parse("S10R").unwrap();
        assert_eq!(spec.local_shape(&[8, 3], &m).unwrap(), vec![2, 3]);
        // rank 2 sits at coordinate (0, 1): index along S10 is c1 * 2 + c0 = 2.
        assert_eq!(
            spec.local_slices(&[8, 3], &m, 2).unwrap(),
            vec![(4, 6), (0, 3)]
        );
    }

    proptest! {
        #[test]
        fn random_specs_round_trip(dims in proptest::collection::vec(0usize..5, 0..6),
                                   perm in Just([0usize, 1, 2, 3]).prop_shuffle()) {
            // Give each mesh axis i (of the first 4, shuffled) to dim dims[i] if that dim exists.
            let rank = dims.len();
            let mut per_dim: Vec<Vec<usize>> = vec![Vec::new(); rank];
            for (i, &axis) in perm.iter().enumerate() {
                if let Some(&d) = dims.get(i) { if d < rank { per_dim[d].push(axis); } }
            }
            let spec = ShardingSpec::from_dims(&per_dim).unwrap();
            let text = spec.to_string();
            let back = ShardingSpec::parse(&text).unwrap();
            prop_assert_eq!(back, spec);
            prop_assert_eq!(back.key(), spec.key());
        }
    }
}
