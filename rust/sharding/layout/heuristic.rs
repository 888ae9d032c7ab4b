//! MAP's greedy heuristic search (Algorithm 1 of the paper), kept as the
//! baseline the exact search is measured against. From the current spec it
//! takes the one-step transform whose dim-by-dim "difference" to the target is
//! smallest, until it reaches the target. The difference is not a time: an
//! all-gather weighs more than a shard, and dims needing several operations
//! pay a step penalty.

use super::moves::{LayoutPath, LayoutProblem, LayoutStep};
use crate::error::{AutomapError, Result};
use crate::sharding::spec::{AxisList, ShardingSpec};

const ALL_GATHER_WEIGHT: u32 = 2;
const SHARD_WEIGHT: u32 = 1;
const STEP_PENALTY: u32 = 1;
/// Longest greedy walk before falling back to gather-all-then-shard.
const MAX_GREEDY_STEPS: usize = 64;

fn dim_difference(src: AxisList, dst: AxisList) -> u32 {
    let common = src
        .as_slice()
        .iter()
        .zip(dst.as_slice())
        .take_while(|(a, b)| a == b)
        .count();
    let gathers = (src.len() - common) as u32;
    let shards = (dst.len() - common) as u32;
    let ops = gathers + shards;
    gathers * ALL_GATHER_WEIGHT + shards * SHARD_WEIGHT + ops.saturating_sub(1) * STEP_PENALTY
}

/// The heuristic's "difference" between two specs of the same rank.
pub fn spec_difference(src: &ShardingSpec, dst: &ShardingSpec) -> u32 {
    (0..src.rank())
        .map(|d| dim_difference(src.dim_axes(d), dst.dim_axes(d)))
        .sum()
}

/// The greedy path from `src` to `dst` (both valid for `problem`).
pub fn heuristic_path(
    problem: &LayoutProblem,
    src: ShardingSpec,
    dst: ShardingSpec,
) -> Result<LayoutPath> {
    let mut steps: Vec<LayoutStep> = Vec::new();
    let mut visited = vec![src.key()];
    let mut at = src;
    let mut moves = Vec::new();
    while at != dst && steps.len() < MAX_GREEDY_STEPS {
        moves.clear();
        problem.moves(&at, &mut moves);
        // Strictly smaller wins, so ties go to the first generated move.
        let best = moves
            .iter()
            .filter(|m| !visited.contains(&m.after.key()))
            .min_by_key(|m| spec_difference(&m.after, &dst));
        let Some(best) = best else { break };
        visited.push(best.after.key());
        at = best.after;
        steps.push(*best);
    }
    if at != dst {
        steps.extend(gather_then_shard(problem, at, dst)?);
    }
    Ok(LayoutPath::from_steps(src, dst, steps))
}

/// Dimension-by-dimension conversion: gather every axis that is not in a
/// common prefix of the target, then shard the missing axes in order.
fn gather_then_shard(
    problem: &LayoutProblem,
    src: ShardingSpec,
    dst: ShardingSpec,
) -> Result<Vec<LayoutStep>> {
    let mut steps = Vec::new();
    let mut at = src;
    let mut moves = Vec::new();
    // Gathers are always legal, and so are the shards towards a valid target.
    let mut take = |at: &mut ShardingSpec, pick: &dyn Fn(&LayoutStep) -> bool| {
        moves.clear();
        problem.moves(at, &mut moves);
        let Some(&step) = moves.iter().find(|m| pick(m)) else {
            return Err(AutomapError::InvalidSpec(format!(
                "no one-step move from {at} towards {dst}: {dst} is not a valid spec of a tensor \
                 of shape {:?}",
                problem.shape()
            )));
        };
        *at = step.after;
        steps.push(step);
        Ok(())
    };
    for d in 0..src.rank() {
        loop {
            let (have, want) = (at.dim_axes(d), dst.dim_axes(d));
            let common = have
                .as_slice()
                .iter()
                .zip(want.as_slice())
                .take_while(|(a, b)| a == b)
                .count();
            if have.len() == common {
                break;
            }
            take(&mut at, &|m| {
                m.kind == super::StepKind::AllGather && m.dim == d
            })?;
        }
    }
    for d in 0..src.rank() {
        while at.dim_axes(d).len() < dst.dim_axes(d).len() {
            let axis = dst.dim_axes(d).as_slice()[at.dim_axes(d).len()] as usize;
            take(&mut at, &|m| {
                m.kind == super::StepKind::Shard && m.dim == d && m.axis == axis
            })?;
        }
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::layout::search::optimal_path;
    use crate::sharding::mesh::DeviceMesh;

    #[test]
    fn heuristic_reaches_target_and_is_never_cheaper_than_optimal() {
        let m = DeviceMesh::new(
            vec![2, 2, 2],
            None,
            vec![1e-6, 1e-5, 1e-4],
            vec![1e11, 1e10, 1e9],
        )
        .unwrap();
        let p = LayoutProblem::new(&m, &[8, 8, 4], 2).unwrap();
        let specs = crate::sharding::layout::search::tests::all_specs(&p);
        for &src in &specs {
            for &dst in &specs {
                let h = heuristic_path(&p, src, dst).unwrap();
                let mut at = src;
                for s in &h.steps {
                    assert_eq!(s.before, at);
                    at = s.after;
                }
                assert_eq!(at, dst, "{src} -> {dst}");
                let o = optimal_path(&p, src, dst).unwrap();
                assert!(o.cost_s() <= h.cost_s() * (1.0 + 1e-12), "{src} -> {dst}");
            }
        }
    }

    #[test]
    fn difference_weights() {
        let s = |x: &str| ShardingSpec::parse(x).unwrap();
        assert_eq!(spec_difference(&s("S0R"), &s("S0R")), 0);
        assert_eq!(spec_difference(&s("S0R"), &s("RR")), ALL_GATHER_WEIGHT);
        assert_eq!(spec_difference(&s("RR"), &s("S0R")), SHARD_WEIGHT);
        assert_eq!(
            spec_difference(&s("S0R"), &s("S1R")),
            ALL_GATHER_WEIGHT + SHARD_WEIGHT + STEP_PENALTY
        );
    }
}
