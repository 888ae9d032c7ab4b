//! Exact minimum-cost layout conversion: A* over sharding specs, edges are the
//! one-step transforms priced in seconds (forward + backward). Ties on cost go
//! to the path with fewer steps. The bound in `LayoutProblem::lower_bound_s`
//! is consistent, so the first time the target is popped its path is optimal.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use super::moves::{LayoutPath, LayoutProblem, LayoutStep};
use crate::error::{limit_exceeded, AutomapError, Result};
use crate::sharding::spec::ShardingSpec;

/// Most specs one search may visit (about 100 MB of bookkeeping); past it the
/// search stops with a typed error instead of running for minutes.
pub const MAX_SEARCH_STATES: usize = 1_000_000;

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
pub fn optimal_path(
    problem: &LayoutProblem,
    src: ShardingSpec,
    dst: ShardingSpec,
) -> Result<LayoutPath> {
    if src == dst {
        return Ok(LayoutPath::from_steps(src, dst, Vec::new()));
    }
    let visits = best_first(problem, src, &[dst], |spec| {
        problem.lower_bound_s(spec, &dst)
    })?;
    rebuild(&visits, src, dst)
}

/// The cheapest paths from `src` to each of `targets`: one Dijkstra that stops
/// once every target is settled (for cost matrices over small spec spaces).
pub fn optimal_paths_from(
    problem: &LayoutProblem,
    src: ShardingSpec,
    targets: &[ShardingSpec],
) -> Result<Vec<LayoutPath>> {
    let visits = best_first(problem, src, targets, |_| 0.0)?;
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
) -> Result<FxHashMap<u64, Visit>> {
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
        let Some(visit) = visits.get_mut(&key) else {
            continue; // every pushed key was inserted first
        };
        if visit.closed {
            continue;
        }
        visit.closed = true;
        let (here, spec) = (visit.cost, visit.spec);
        if targets.iter().any(|t| t.key() == key) {
            open_targets -= 1;
            if open_targets == 0 {
                return Ok(visits);
            }
        }
        if visits.len() > MAX_SEARCH_STATES {
            return limit_exceeded(format!(
                "the layout search for a tensor of shape {:?} on a mesh of shape {:?} visited \
                 more than {MAX_SEARCH_STATES} specs (the cap); use a mesh with fewer axes of \
                 size > 1",
                problem.shape(),
                problem.mesh_shape
            ));
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
    // Every valid spec reaches every other (gather all, then shard).
    Err(unreachable_target(problem, src))
}

fn unreachable_target(problem: &LayoutProblem, src: ShardingSpec) -> AutomapError {
    AutomapError::InvalidSpec(format!(
        "no conversion from {src} reaches the target on a tensor of shape {:?}: the target is \
         not a valid spec of this tensor and mesh",
        problem.shape()
    ))
}

fn rebuild(
    visits: &FxHashMap<u64, Visit>,
    src: ShardingSpec,
    dst: ShardingSpec,
) -> Result<LayoutPath> {
    let mut steps = Vec::new();
    let mut key = dst.key();
    loop {
        let Some(visit) = visits.get(&key) else {
            return Err(AutomapError::InvalidSpec(format!(
                "no conversion from {src} to {dst} was found"
            )));
        };
        let Some(step) = visit.via else { break };
        steps.push(step);
        key = step.before.key();
    }
    steps.reverse();
    Ok(LayoutPath::from_steps(src, dst, steps))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sharding::layout::moves::StepKind;
    use crate::sharding::mesh::DeviceMesh;

    /// A mesh whose later axes are slower (alpha and bandwidth per axis).
    pub(crate) fn test_mesh(mesh: &[usize]) -> DeviceMesh {
        DeviceMesh::new(
            mesh.to_vec(),
            None,
            (0..mesh.len()).map(|a| 1e-5 * (a + 1) as f64).collect(),
            (0..mesh.len()).map(|a| 1e9 / (a + 1) as f64).collect(),
        )
        .unwrap()
    }

    fn problem(mesh: &[usize], shape: &[usize]) -> LayoutProblem {
        LayoutProblem::new(&test_mesh(mesh), shape, 4).unwrap()
    }

    pub(crate) fn all_specs(p: &LayoutProblem) -> Vec<ShardingSpec> {
        crate::sharding::enumerate::enumerate_specs(&p.shape, &p.mesh_shape).unwrap()
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
                    let path = optimal_path(&p, src, dst).unwrap();
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
            let many = optimal_paths_from(&p, src, &specs).unwrap();
            for (path, &dst) in many.iter().zip(&specs) {
                let single = optimal_path(&p, src, dst).unwrap();
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
        )
        .unwrap();
        assert_eq!(path.steps.len(), 1);
        assert_eq!(path.steps[0].kind, StepKind::AllToAll);
    }
}
