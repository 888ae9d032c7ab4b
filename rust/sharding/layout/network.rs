//! The conversions of one ILP edge as a network (issue 15, "shrink the
//! formulation"). An edge between a producer with specs `srcs` and a consumer
//! with specs `dsts` is priced in the ILP by the cost matrix `R[a][b]`, the
//! optimal path's seconds; one variable per pair is `|srcs| x |dsts|`
//! variables. Every optimal path is a chain of single steps whose costs add
//! up (`LayoutPath::from_steps`), so the same prices come out of a min-cost
//! flow over the union of the steps of one optimal path per pair: a flow from
//! `a` to `b` costs at least the cheapest path between them in that
//! subnetwork, which is `R[a][b]` (the optimal path is in it and no path of
//! the whole spec graph is cheaper). The flow LP therefore has the transport
//! LP's value for every (fractional) choice of the two nodes' strategies.

use rustc_hash::FxHashMap;

use super::cache::LayoutContext;
use super::search::optimal_paths_from;
use crate::error::Result;
use crate::sharding::spec::ShardingSpec;

/// The specs an edge's conversions pass through (sources and targets first,
/// in order, then intermediates) and one arc per distinct single step.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversionNetwork {
    pub num_specs: usize,
    /// Position of each of `srcs` / `dsts` among the network's specs.
    pub src_pos: Vec<u32>,
    pub dst_pos: Vec<u32>,
    pub arc_from: Vec<u32>,
    pub arc_to: Vec<u32>,
    /// Forward + backward seconds of the step (the cheapest where two
    /// optimal paths take different steps between the same specs).
    pub arc_cost_s: Vec<f64>,
}

impl LayoutContext {
    /// The network of the optimal paths from every spec of `srcs` to every
    /// spec of `dsts` (duplicates allowed; they share a position).
    pub fn conversion_network(
        &self,
        srcs: &[ShardingSpec],
        dsts: &[ShardingSpec],
    ) -> Result<ConversionNetwork> {
        for spec in srcs.iter().chain(dsts) {
            self.problem().validate(spec)?;
        }
        let mut position: FxHashMap<u64, u32> = FxHashMap::default();
        let mut place = |spec: &ShardingSpec| -> u32 {
            let next = position.len() as u32;
            *position.entry(spec.key()).or_insert(next)
        };
        let src_pos: Vec<u32> = srcs.iter().map(&mut place).collect();
        let dst_pos: Vec<u32> = dsts.iter().map(&mut place).collect();
        let mut targets: Vec<ShardingSpec> = dsts.to_vec();
        targets.sort_unstable_by_key(|d| d.key());
        targets.dedup();
        let mut sources: Vec<ShardingSpec> = srcs.to_vec();
        sources.sort_unstable_by_key(|s| s.key());
        sources.dedup();
        let mut arcs: FxHashMap<(u32, u32), f64> = FxHashMap::default();
        let row_wise = self.small_space()?;
        for &src in &sources {
            let others: Vec<ShardingSpec> = targets.iter().copied().filter(|&d| d != src).collect();
            if others.is_empty() {
                continue;
            }
            // One Dijkstra per source where the spec space is small (its tree
            // holds an optimal path to every target), one A* per pair (cached)
            // where it is not, as cost matrices are searched.
            let paths = if row_wise {
                optimal_paths_from(self.problem(), src, &others)?
            } else {
                others
                    .iter()
                    .map(|&d| self.path(&src, &d).map(|p| (*p).clone()))
                    .collect::<Result<Vec<_>>>()?
            };
            for path in paths {
                for step in &path.steps {
                    let arc = (place(&step.before), place(&step.after));
                    let cost = arcs.entry(arc).or_insert(f64::INFINITY);
                    *cost = cost.min(step.cost_s());
                }
            }
        }
        let mut sorted: Vec<((u32, u32), f64)> = arcs.into_iter().collect();
        sorted.sort_unstable_by_key(|(arc, _)| *arc);
        Ok(ConversionNetwork {
            num_specs: position.len(),
            src_pos,
            dst_pos,
            arc_from: sorted.iter().map(|((a, _), _)| *a).collect(),
            arc_to: sorted.iter().map(|((_, b), _)| *b).collect(),
            arc_cost_s: sorted.iter().map(|(_, c)| *c).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::layout::layout_context;
    use crate::sharding::layout::search::tests::test_mesh;

    /// Cheapest path costs in the network (Bellman-Ford: few specs).
    fn network_distances(net: &ConversionNetwork, from: u32) -> Vec<f64> {
        let mut dist = vec![f64::INFINITY; net.num_specs];
        dist[from as usize] = 0.0;
        for _ in 0..net.num_specs {
            for k in 0..net.arc_from.len() {
                let (a, b) = (net.arc_from[k] as usize, net.arc_to[k] as usize);
                dist[b] = dist[b].min(dist[a] + net.arc_cost_s[k]);
            }
        }
        dist
    }

    #[test]
    fn network_distances_are_the_cost_matrix() {
        for (mesh, shape) in [(&[2, 2, 2][..], &[8, 4, 16][..]), (&[2, 4], &[8, 12])] {
            let m = test_mesh(mesh);
            let ctx = layout_context(&m, shape, 4).unwrap();
            let specs = crate::sharding::enumerate::enumerate_specs(shape, m.shape()).unwrap();
            let srcs: Vec<_> = specs.iter().copied().step_by(3).collect();
            let dsts: Vec<_> = specs.iter().copied().skip(1).step_by(2).collect();
            let net = ctx.conversion_network(&srcs, &dsts).unwrap();
            let r = ctx.cost_matrix(&srcs, &dsts).unwrap();
            assert!(net.arc_from.len() < srcs.len() * dsts.len());
            for (i, _) in srcs.iter().enumerate() {
                let dist = network_distances(&net, net.src_pos[i]);
                for (j, _) in dsts.iter().enumerate() {
                    let want = r.forward_s[i * r.cols + j] + r.backward_s[i * r.cols + j];
                    let got = dist[net.dst_pos[j] as usize];
                    assert!(
                        (got - want).abs() <= 1e-9 * want.max(1e-12),
                        "{i} {j}: {got} {want}"
                    );
                }
            }
        }
    }
}
