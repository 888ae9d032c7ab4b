//! The logical device mesh: an N-D grid over global ranks, with an alpha-beta
//! link model per axis, and the ring formulas that price one collective on
//! one group of devices (`collective` chooses the algorithm over several axes).

use super::collective::{collective_cost_s, collective_plan, CollectivePlan, Links};
use crate::error::{checked_product, invalid_mesh, limit_exceeded, Result};

/// Most mesh axes a spec can name (axes are single digits in the spec string,
/// and a spec packs one byte per axis).
pub const MAX_MESH_AXES: usize = 8;

/// Most devices a mesh may hold (2^20, ten times the largest clusters built
/// so far): the mesh stores one rank per device, so a typo such as
/// `(10**6, 10**6)` must fail here instead of allocating terabytes.
pub const MAX_MESH_DEVICES: usize = 1 << 20;

/// The collectives the cost model knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Collective {
    AllGather,
    ReduceScatter,
    AllReduce,
    AllToAll,
    Broadcast,
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllReduce => "all_reduce",
            Collective::AllToAll => "all_to_all",
            Collective::Broadcast => "broadcast",
        }
    }

    pub fn from_name(name: &str) -> Option<Collective> {
        Some(match name {
            "all_gather" => Collective::AllGather,
            "reduce_scatter" => Collective::ReduceScatter,
            "all_reduce" => Collective::AllReduce,
            "all_to_all" => Collective::AllToAll,
            "broadcast" => Collective::Broadcast,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeviceMesh {
    shape: Vec<usize>,
    /// Global rank at each mesh position, row-major (last axis fastest).
    ranks: Vec<i64>,
    alpha_s: Vec<f64>,
    bandwidth_bytes_per_s: Vec<f64>,
    /// The collective backend runs a reduce-scatter as an all-reduce (gloo).
    reduce_scatter_as_all_reduce: bool,
}

impl DeviceMesh {
    /// `ranks` defaults to 0..n; `alpha_s` and bandwidth are per axis.
    pub fn new(
        shape: Vec<usize>,
        ranks: Option<Vec<i64>>,
        alpha_s: Vec<f64>,
        bandwidth_bytes_per_s: Vec<f64>,
    ) -> Result<DeviceMesh> {
        if shape.is_empty() {
            return invalid_mesh("a device mesh needs at least one axis, got shape ()");
        }
        if shape.len() > MAX_MESH_AXES {
            return invalid_mesh(format!(
                "a device mesh has at most {MAX_MESH_AXES} axes, got shape {shape:?}"
            ));
        }
        if let Some(axis) = shape.iter().position(|&n| n == 0) {
            return invalid_mesh(format!("mesh axis {axis} has size 0 in shape {shape:?}"));
        }
        let size = match checked_product(shape.iter().copied()) {
            Some(n) if n <= MAX_MESH_DEVICES => n,
            _ => {
                return limit_exceeded(format!(
                    "mesh shape {shape:?} holds {} devices; a mesh holds at most \
                     {MAX_MESH_DEVICES} (2^20)",
                    shape.iter().map(|&n| n as f64).product::<f64>()
                ))
            }
        };
        let ranks = match ranks {
            None => (0..size as i64).collect(),
            Some(r) => r,
        };
        if ranks.len() != size {
            return invalid_mesh(format!(
                "mesh shape {shape:?} holds {size} devices but {} ranks were given",
                ranks.len()
            ));
        }
        let mut sorted = ranks.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return invalid_mesh(format!("rank {} appears twice in the mesh", w[0]));
        }
        if let Some(r) = sorted.first().filter(|r| **r < 0) {
            return invalid_mesh(format!("ranks must be >= 0, got {r}"));
        }
        for (what, v) in [
            ("alpha_s", &alpha_s),
            ("bandwidth_bytes_per_s", &bandwidth_bytes_per_s),
        ] {
            if v.len() != shape.len() {
                return invalid_mesh(format!(
                    "{what} has {} entries but the mesh has {} axes",
                    v.len(),
                    shape.len()
                ));
            }
        }
        if let Some((a, x)) = alpha_s
            .iter()
            .enumerate()
            .find(|(_, x)| !(x.is_finite() && **x >= 0.0))
        {
            return invalid_mesh(format!(
                "alpha_s of axis {a} must be finite and >= 0, got {x}"
            ));
        }
        if let Some((a, x)) = bandwidth_bytes_per_s
            .iter()
            .enumerate()
            .find(|(_, x)| !(x.is_finite() && **x > 0.0))
        {
            return invalid_mesh(format!(
                "bandwidth_bytes_per_s of axis {a} must be finite and > 0, got {x}"
            ));
        }
        Ok(DeviceMesh {
            shape,
            ranks,
            alpha_s,
            bandwidth_bytes_per_s,
            reduce_scatter_as_all_reduce: false,
        })
    }

    /// The same mesh on a backend that runs (or not) a reduce-scatter as an
    /// all-reduce of its whole input: gloo does, so it costs one there.
    pub fn with_reduce_scatter_as_all_reduce(mut self, on: bool) -> DeviceMesh {
        self.reduce_scatter_as_all_reduce = on;
        self
    }

    pub fn reduce_scatter_as_all_reduce(&self) -> bool {
        self.reduce_scatter_as_all_reduce
    }

    /// A mesh with the same link parameters on every axis.
    pub fn uniform(
        shape: Vec<usize>,
        alpha_s: f64,
        bandwidth_bytes_per_s: f64,
    ) -> Result<DeviceMesh> {
        let n = shape.len();
        DeviceMesh::new(
            shape,
            None,
            vec![alpha_s; n],
            vec![bandwidth_bytes_per_s; n],
        )
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    pub fn ranks(&self) -> &[i64] {
        &self.ranks
    }
    pub fn alpha_s(&self) -> &[f64] {
        &self.alpha_s
    }
    pub fn bandwidth_bytes_per_s(&self) -> &[f64] {
        &self.bandwidth_bytes_per_s
    }

    fn check_axis(&self, axis: usize) -> Result<()> {
        if axis >= self.ndim() {
            return invalid_mesh(format!(
                "mesh axis {axis} is out of range for a {}-D mesh of shape {:?}",
                self.ndim(),
                self.shape
            ));
        }
        Ok(())
    }

    /// Mesh coordinate of a global rank.
    pub fn coordinate(&self, rank: i64) -> Result<Vec<usize>> {
        let Some(mut flat) = self.ranks.iter().position(|&r| r == rank) else {
            return invalid_mesh(format!(
                "rank {rank} is not in the mesh (ranks {:?})",
                self.ranks
            ));
        };
        let mut coord = vec![0; self.ndim()];
        for axis in (0..self.ndim()).rev() {
            coord[axis] = flat % self.shape[axis];
            flat /= self.shape[axis];
        }
        Ok(coord)
    }

    /// Global rank at a mesh coordinate.
    pub fn rank_at(&self, coord: &[usize]) -> Result<i64> {
        if coord.len() != self.ndim() {
            return invalid_mesh(format!(
                "coordinate {coord:?} has {} entries, the mesh has {} axes",
                coord.len(),
                self.ndim()
            ));
        }
        let mut flat = 0;
        for (axis, (&c, &n)) in coord.iter().zip(&self.shape).enumerate() {
            if c >= n {
                return invalid_mesh(format!(
                    "coordinate {c} is out of range for axis {axis} of size {n}"
                ));
            }
            flat = flat * n + c;
        }
        Ok(self.ranks[flat])
    }

    /// The groups of ranks that communicate along `axes` (in the given order:
    /// the first axis is the most significant). Each group lists its ranks by
    /// increasing linear index over `axes`, so a rank's position in its group
    /// is its shard index; groups are ordered by the remaining coordinates.
    pub fn axis_groups(&self, axes: &[usize]) -> Result<Vec<Vec<i64>>> {
        self.check_axes(axes)?;
        let rest: Vec<usize> = (0..self.ndim()).filter(|a| !axes.contains(a)).collect();
        let group_size: usize = axes.iter().map(|&a| self.shape[a]).product();
        let n_groups = self.size() / group_size;
        let mut groups = Vec::with_capacity(n_groups);
        let mut coord = vec![0usize; self.ndim()];
        for g in 0..n_groups {
            set_mixed_radix(&mut coord, &rest, &self.shape, g);
            let mut members = Vec::with_capacity(group_size);
            for i in 0..group_size {
                set_mixed_radix(&mut coord, axes, &self.shape, i);
                members.push(self.rank_at(&coord)?);
            }
            groups.push(members);
        }
        Ok(groups)
    }

    /// Checks that `axes` are in range and distinct.
    fn check_axes(&self, axes: &[usize]) -> Result<()> {
        let mut seen = [false; MAX_MESH_AXES];
        for &a in axes {
            self.check_axis(a)?;
            if seen[a] {
                return invalid_mesh(format!("mesh axis {a} is named twice in {axes:?}"));
            }
            seen[a] = true;
        }
        Ok(())
    }

    pub fn links(&self) -> Links<'_> {
        Links {
            shape: &self.shape,
            alpha_s: &self.alpha_s,
            bandwidth_bytes_per_s: &self.bandwidth_bytes_per_s,
            reduce_scatter_as_all_reduce: self.reduce_scatter_as_all_reduce,
        }
    }

    /// Time in seconds of one collective over the devices along `axes`: the
    /// cheaper of one flat ring and a per-axis algorithm (see
    /// `sharding::collective`). `bytes` is the per-device buffer the collective
    /// is about: the output of an all-gather, the input of a reduce-scatter,
    /// the buffer of an all-reduce, all-to-all or broadcast.
    pub fn collective_cost_s(&self, kind: Collective, bytes: f64, axes: &[usize]) -> Result<f64> {
        self.check_axes(axes)?;
        Ok(collective_cost_s(kind, bytes, axes, &self.links()))
    }

    /// The algorithm `collective_cost_s` prices: its steps and their cost.
    pub fn collective_plan(
        &self,
        kind: Collective,
        bytes: f64,
        axes: &[usize],
    ) -> Result<CollectivePlan> {
        self.check_axes(axes)?;
        Ok(collective_plan(kind, bytes, axes, &self.links()))
    }
}

/// Ring alpha-beta formulas; a group of one device costs nothing.
#[inline]
pub fn ring_cost_s(kind: Collective, bytes: f64, n: usize, bw: f64, alpha: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let frac = (n - 1) as f64 / n as f64;
    let volume = match kind {
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => frac * bytes,
        Collective::AllReduce => 2.0 * frac * bytes,
        Collective::Broadcast => bytes,
    };
    volume / bw + alpha
}

/// Write `index` as mixed-radix digits over `axes` into `coord` (first axis most significant).
fn set_mixed_radix(coord: &mut [usize], axes: &[usize], shape: &[usize], mut index: usize) {
    for &a in axes.iter().rev() {
        coord[a] = index % shape[a];
        index /= shape[a];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(shape: &[usize]) -> DeviceMesh {
        DeviceMesh::uniform(shape.to_vec(), 1e-5, 1e9).unwrap()
    }

    #[test]
    fn coordinates_round_trip_with_custom_rank_order() {
        let m = DeviceMesh::new(
            vec![3, 2],
            Some(vec![5, 4, 3, 2, 1, 0]),
            vec![0.0; 2],
            vec![1.0; 2],
        )
        .unwrap();
        assert_eq!(m.coordinate(5).unwrap(), vec![0, 0]);
        assert_eq!(m.coordinate(2).unwrap(), vec![1, 1]);
        for &r in m.ranks() {
            assert_eq!(m.rank_at(&m.coordinate(r).unwrap()).unwrap(), r);
        }
        assert!(m.coordinate(7).is_err());
    }

    #[test]
    fn axis_groups_follow_coordinates() {
        let m = mesh(&[2, 3]);
        assert_eq!(
            m.axis_groups(&[0]).unwrap(),
            vec![vec![0, 3], vec![1, 4], vec![2, 5]]
        );
        assert_eq!(
            m.axis_groups(&[1]).unwrap(),
            vec![vec![0, 1, 2], vec![3, 4, 5]]
        );
        assert_eq!(
            m.axis_groups(&[1, 0]).unwrap(),
            vec![vec![0, 3, 1, 4, 2, 5]]
        );
        assert!(m.axis_groups(&[0, 0]).is_err());
        assert!(m.axis_groups(&[2]).is_err());
    }

    #[test]
    fn ring_formulas() {
        let m = DeviceMesh::new(vec![4, 2], None, vec![1e-5, 2e-5], vec![1e9, 1e8]).unwrap();
        let ar = m
            .collective_cost_s(Collective::AllReduce, 1e6, &[0])
            .unwrap();
        assert!((ar - (2.0 * 3.0 / 4.0 * 1e6 / 1e9 + 1e-5)).abs() < 1e-15);
        let ag = m
            .collective_cost_s(Collective::AllGather, 1e6, &[0, 1])
            .unwrap();
        // Per axis beats one ring at the slow axis's pace (7/8 * 1e6 / 1e8 + 2e-5):
        // gather the quarter along the slow axis, then the whole along the fast one.
        let per_axis = 0.5 * 0.25e6 / 1e8 + 2e-5 + 0.75 * 1e6 / 1e9 + 1e-5;
        assert!((ag - per_axis).abs() < 1e-15);
        let bc = m
            .collective_cost_s(Collective::Broadcast, 1e6, &[1])
            .unwrap();
        assert!((bc - (1e6 / 1e8 + 2e-5)).abs() < 1e-15);
        let one = DeviceMesh::uniform(vec![1, 4], 1.0, 1.0).unwrap();
        assert_eq!(
            one.collective_cost_s(Collective::AllToAll, 1e6, &[0])
                .unwrap(),
            0.0
        );
    }

    #[test]
    fn bad_meshes_are_rejected() {
        assert!(DeviceMesh::uniform(vec![], 0.0, 1.0).is_err());
        assert!(DeviceMesh::uniform(vec![2, 0], 0.0, 1.0).is_err());
        assert!(DeviceMesh::new(vec![2], Some(vec![0, 0]), vec![0.0], vec![1.0]).is_err());
        assert!(DeviceMesh::new(vec![2], Some(vec![0, 1, 2]), vec![0.0], vec![1.0]).is_err());
        assert!(DeviceMesh::new(vec![2], None, vec![0.0], vec![0.0]).is_err());
        assert!(DeviceMesh::new(vec![2], None, vec![-1.0], vec![1.0]).is_err());
        // Too many devices: refused before the rank list is allocated, also
        // where the product overflows a usize (2^32 * 2^32).
        for shape in [vec![1_000_000, 1_000_000], vec![1 << 32, 1 << 32]] {
            let e = DeviceMesh::uniform(shape, 0.0, 1.0).unwrap_err();
            assert!(matches!(e, crate::AutomapError::LimitExceeded(_)), "{e}");
            assert!(e.to_string().contains("at most 1048576"), "{e}");
        }
    }
}
