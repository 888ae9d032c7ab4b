//! Exact minimum-cost layout conversion: A* over sharding specs, edges are the
//! one-step transforms priced in seconds (forward + backward). Ties on cost go
//! to the path with fewer steps. The bound in `LayoutProblem::lower_bound_s`
//! is consistent, so the first time the target is popped its path is optimal.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use super::moves::{LayoutPath, LayoutProblem, LayoutStep};
use crate::sharding::spec::ShardingSpec;

/// Path cost, ordered by seconds then by step count.
#[derive(Clone, Copy, PartialEq)]
struct Cost {
    seconds: f64,
    steps: u32,
}

impl Cost {
    fn cmp_total(&self, other: &Cost) -> Ordering {
        self.seconds
            .total_cmp(&other.seconds)
            .then(self.steps.cmp(&other.steps))
    }
}

#[derive(PartialEq)]
struct Frontier {
    priority: Cost, // cost so far + lower bound to the target
    key: u64,
}

impl Eq for Frontier {}
impl Ord for Frontier {
    fn cmp(&self, other: &Self) -> Ordering {
        // BinaryHeap is a max-heap: reverse for smallest-first.
        other.priority.cmp_total(&self.priority)
    }
}
impl PartialOrd for Frontier {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

struct Visit {
    cost: Cost,
    spec: ShardingSpec,
    /// The step that reached this spec (None at the source).
    via: Option<LayoutStep>,
    closed: bool,
}

/// The cheapest path from `src` to `dst` (both must be valid for `problem`).
pub fn optimal_path(problem: &LayoutProblem, src: ShardingSpec, dst: ShardingSpec) -> LayoutPath {
    if src == dst {
        return LayoutPath::from_steps(src, dst, Vec::new());
    }
    let visits = best_first(problem, src, &[dst], |spec| {
        problem.lower_bound_s(spec, &dst)
    });
    rebuild(&visits, src, dst)
}

/// The cheapest paths from `src` to each of `targets`: one Dijkstra that stops
/// once every target is settled (for cost matrices: one search per row).
pub fn optimal_paths_from(
    problem: &LayoutProblem,
    src: ShardingSpec,
    targets: &[ShardingSpec],
) -> Vec<LayoutPath> {
    let visits = best_first(problem, src, targets, |_| 0.0);
    targets
        .iter()
        .map(|&dst| rebuild(&visits, src, dst))
        .collect()
}

/// Best-first search from `src` until every target is closed; `bound` is a
/// consistent lower bound on the remaining cost (zero for plain Dijkstra).
fn best_first(
    problem: &LayoutProblem,
    src: ShardingSpec,
    targets: &[ShardingSpec],
    bound: impl Fn(&ShardingSpec) -> f64,
) -> FxHashMap<u64, Visit> {
    let mut visits: FxHashMap<u64, Visit> = FxHashMap::default();
    visits.reserve(64);
    let mut heap = BinaryHeap::with_capacity(64);
    let mut moves = Vec::with_capacity(32);
    let start = Cost {
        seconds: 0.0,
        steps: 0,
    };
    visits.insert(
        src.key(),
        Visit {
            cost: start,
            spec: src,
            via: None,
            closed: false,
        },
    );
    heap.push(Frontier {
        priority: start,
        key: src.key(),
    });
    let mut open_targets = targets.len();

    while let Some(Frontier { key, .. }) = heap.pop() {
        let visit = visits.get_mut(&key).expect("frontier entries are visited");
        if visit.closed {
            continue;
        }
        visit.closed = true;
        let (here, spec) = (visit.cost, visit.spec);
        if targets.iter().any(|t| t.key() == key) {
            open_targets -= 1;
            if open_targets == 0 {
                return visits;
            }
        }
        moves.clear();
        problem.moves(&spec, &mut moves);
        for step in moves.drain(..) {
            let next = step.after.key();
            let cost = Cost {
                seconds: here.seconds + step.cost_s(),
                steps: here.steps + 1,
            };
            let better = match visits.get(&next) {
                None => true,
                Some(v) => !v.closed && cost.cmp_total(&v.cost) == Ordering::Less,
            };
            if better {
                let priority = Cost {
                    seconds: cost.seconds + bound(&step.after),
                    steps: cost.steps,
                };
                visits.insert(
                    next,
                    Visit {
                        cost,
                        spec: step.after,
                        via: Some(step),
                        closed: false,
                    },
                );
                heap.push(Frontier {
                    priority,
                    key: next,
                });
            }
        }
    }
    assert_eq!(
        open_targets, 0,
        "every valid spec reaches every other valid spec of a tensor"
    );
    visits
}

fn rebuild(visits: &FxHashMap<u64, Visit>, src: ShardingSpec, dst: ShardingSpec) -> LayoutPath {
    let mut steps = Vec::new();
    let mut key = dst.key();
    while let Some(step) = visits[&key].via {
        steps.push(step);
        key = step.before.key();
    }
    steps.reverse();
    LayoutPath::from_steps(src, dst, steps)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sharding::layout::moves::StepKind;
    use crate::sharding::mesh::DeviceMesh;

    fn problem(mesh: &[usize], shape: &[usize]) -> LayoutProblem {
        let m = DeviceMesh::new(
            mesh.to_vec(),
            None,
            (0..mesh.len()).map(|a| 1e-5 * (a + 1) as f64).collect(),
            (0..mesh.len()).map(|a| 1e9 / (a + 1) as f64).collect(),
        )
        .unwrap();
        LayoutProblem::new(&m, shape, 4)
    }

    pub(crate) fn all_specs(p: &LayoutProblem) -> Vec<ShardingSpec> {
        crate::sharding::enumerate::enumerate_specs(&p.shape, &p.mesh_shape)
    }

    /// Plain Dijkstra without the bound, from one source to every spec.
    fn dijkstra_all(p: &LayoutProblem, src: ShardingSpec, specs: &[ShardingSpec]) -> Vec<f64> {
        let idx = |s: &ShardingSpec| specs.iter().position(|x| x == s).unwrap();
        let mut dist = vec![f64::INFINITY; specs.len()];
        let mut done = vec![false; specs.len()];
        dist[idx(&src)] = 0.0;
        let mut moves = Vec::new();
        for _ in 0..specs.len() {
            let u = (0..specs.len())
                .filter(|&i| !done[i])
                .min_by(|&a, &b| dist[a].total_cmp(&dist[b]))
                .unwrap();
            done[u] = true;
            moves.clear();
            p.moves(&specs[u], &mut moves);
            for m in &moves {
                let v = idx(&m.after);
                dist[v] = dist[v].min(dist[u] + m.cost_s());
            }
        }
        dist
    }

    #[test]
    fn astar_matches_dijkstra_on_every_pair() {
        for (mesh, shape) in [
            (&[2, 2][..], &[4, 4, 2][..]),
            (&[2, 2, 2], &[8, 4]),
            (&[3, 2], &[6, 6, 2]),
        ] {
            let p = problem(mesh, shape);
            let specs = all_specs(&p);
            for &src in &specs {
                let dist = dijkstra_all(&p, src, &specs);
                for (j, &dst) in specs.iter().enumerate() {
                    let path = optimal_path(&p, src, dst);
                    assert!(
                        (path.cost_s() - dist[j]).abs() <= 1e-12 * dist[j].max(1e-9),
                        "{src} -> {dst}"
                    );
                    // The path is a chain of legal moves from src to dst.
                    let mut at = src;
                    for step in &path.steps {
                        assert_eq!(step.before, at);
                        at = step.after;
                    }
                    assert_eq!(at, dst);
                }
            }
        }
    }

    #[test]
    fn one_source_many_targets_agrees_with_single_searches() {
        let p = problem(&[2, 2, 2], &[8, 4, 2]);
        let specs = all_specs(&p);
        for &src in specs.iter().step_by(7) {
            let many = optimal_paths_from(&p, src, &specs);
            for (path, &dst) in many.iter().zip(&specs) {
                let single = optimal_path(&p, src, dst);
                assert_eq!(path.dst, dst);
                assert!(
                    (path.cost_s() - single.cost_s()).abs() <= 1e-12 * single.cost_s().max(1e-9)
                );
                assert_eq!(path.steps.len(), single.steps.len());
            }
        }
    }

    #[test]
    fn all_to_all_beats_gather_then_shard() {
        let p = problem(&[4], &[64, 64]);
        let path = optimal_path(
            &p,
            ShardingSpec::parse("S0R").unwrap(),
            ShardingSpec::parse("RS0").unwrap(),
        );
        assert_eq!(path.steps.len(), 1);
        assert_eq!(path.steps[0].kind, StepKind::AllToAll);
    }
}
