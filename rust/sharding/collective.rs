//! How a collective over several mesh axes runs, and what it costs. The
//! candidate algorithms are priced with the ring formulas and the cheapest is
//! chosen, so that the planner's prices and the generated program (which asks
//! the same question through `collective_plan`) agree:
//!
//! - flat: one ring over the flattened group (one process group over all its
//!   ranks), at the slowest axis's bandwidth and the largest latency;
//! - per axis, one collective per step, each on its own links. An all-reduce
//!   reduce-scatters along some axes (each step on the bytes left), all-reduces
//!   the reduced share along the others (in one group, or axis by axis) and
//!   all-gathers back in reverse order; a reduce-scatter scatters axis by axis
//!   and an all-gather gathers axis by axis; an all-to-all or a broadcast runs
//!   once per axis on the whole buffer.
//!
//! Scatter steps run fastest axis first, on the largest buffer (gathers mirror
//! them): swapping adjacent scatter steps on axes i then j changes the time by
//! `b (1 - 1/n_i)(1 - 1/n_j)(1/bw_i - 1/bw_j)`, and latency does not depend on
//! the order, so sorting by bandwidth is optimal. Ties between candidates go
//! to the earlier one in a fixed order, the flat ring first; equal
//! bandwidths go to the lower axis index.

use super::mesh::{ring_cost_s, Collective, MAX_MESH_AXES};

/// One step of a collective's algorithm: the collective `kind` over the devices
/// along `axes` (one process group) on a per-device buffer of `bytes` (the
/// output of an all-gather, the input of a reduce-scatter, the buffer of the
/// others), priced with the ring formulas.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectiveStep {
    pub kind: Collective,
    pub axes: Vec<usize>,
    pub bytes: f64,
    pub cost_s: f64,
}

/// The chosen algorithm of one collective: its steps in execution order and
/// their summed cost. One step (or none, for a group of one device) is the
/// flat ring.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectivePlan {
    pub kind: Collective,
    pub bytes: f64,
    pub steps: Vec<CollectiveStep>,
    pub cost_s: f64,
}

impl CollectivePlan {
    pub fn is_flat(&self) -> bool {
        self.steps.len() <= 1
    }
}

/// A mesh's link model, borrowed.
#[derive(Clone, Copy)]
pub struct Links<'a> {
    pub shape: &'a [usize],
    pub alpha_s: &'a [f64],
    pub bandwidth_bytes_per_s: &'a [f64],
    /// The backend runs a reduce-scatter as an all-reduce of its whole input
    /// (gloo), so it costs one.
    pub reduce_scatter_as_all_reduce: bool,
}

impl Links<'_> {
    /// One ring over the devices along `axes`: slowest link, largest latency.
    fn ring_s(&self, kind: Collective, bytes: f64, axes: &[usize]) -> f64 {
        let kind = match kind {
            Collective::ReduceScatter if self.reduce_scatter_as_all_reduce => Collective::AllReduce,
            other => other,
        };
        let mut n = 1;
        let mut bw = f64::INFINITY;
        let mut alpha = 0.0f64;
        for &a in axes {
            n *= self.shape[a];
            bw = bw.min(self.bandwidth_bytes_per_s[a]);
            alpha = alpha.max(self.alpha_s[a]);
        }
        ring_cost_s(kind, bytes, n, bw, alpha)
    }
}

/// A short list of axes, without allocating.
#[derive(Clone, Copy)]
struct Axes {
    items: [usize; MAX_MESH_AXES],
    len: usize,
}

impl Axes {
    fn new() -> Axes {
        Axes {
            items: [0; MAX_MESH_AXES],
            len: 0,
        }
    }
    fn push(&mut self, a: usize) {
        self.items[self.len] = a;
        self.len += 1;
    }
    fn as_slice(&self) -> &[usize] {
        &self.items[..self.len]
    }
}

#[derive(Clone, Copy)]
enum Algorithm {
    Flat,
    /// One step per axis (all-gather, reduce-scatter, all-to-all, broadcast).
    PerAxis,
    /// All-reduce: reduce-scatter along the sorted axes whose bit is set in
    /// `scatter`, all-reduce along the rest (in one group when `joint`),
    /// all-gather back.
    ScatterReduceGather {
        scatter: u32,
        joint: bool,
    },
}

/// Calls `step(kind, axes, bytes)` for every step of `alg`, in execution order.
/// `given` are the participating axes in the caller's order, `sorted` the same
/// axes fastest first.
fn for_each_step(
    kind: Collective,
    alg: Algorithm,
    bytes: f64,
    given: &Axes,
    sorted: &Axes,
    shape: &[usize],
    step: &mut impl FnMut(Collective, &[usize], f64),
) {
    let sorted = sorted.as_slice();
    match alg {
        // A group of one device runs nothing.
        Algorithm::Flat if given.len == 0 => {}
        Algorithm::Flat => step(kind, given.as_slice(), bytes),
        Algorithm::PerAxis => match kind {
            Collective::ReduceScatter => {
                let mut b = bytes;
                for &a in sorted {
                    step(kind, &[a], b);
                    b /= shape[a] as f64;
                }
            }
            Collective::AllGather => {
                // The last gather, on the fastest axis, outputs the whole buffer.
                let mut b = bytes / sorted.iter().map(|&a| shape[a] as f64).product::<f64>();
                for &a in sorted.iter().rev() {
                    b *= shape[a] as f64;
                    step(kind, &[a], b);
                }
            }
            _ => {
                for &a in sorted {
                    step(kind, &[a], bytes);
                }
            }
        },
        Algorithm::ScatterReduceGather { scatter, joint } => {
            let scattered = |i: usize| scatter & (1 << i) != 0;
            let mut b = bytes;
            let mut rest = Axes::new();
            for (i, &a) in sorted.iter().enumerate() {
                if scattered(i) {
                    step(Collective::ReduceScatter, &[a], b);
                    b /= shape[a] as f64;
                } else {
                    rest.push(a);
                }
            }
            if joint {
                step(Collective::AllReduce, rest.as_slice(), b);
            } else {
                for &a in rest.as_slice() {
                    step(Collective::AllReduce, &[a], b);
                }
            }
            for (i, &a) in sorted.iter().enumerate().rev() {
                if scattered(i) {
                    b *= shape[a] as f64;
                    step(Collective::AllGather, &[a], b);
                }
            }
        }
    }
}

/// The cheapest algorithm for `kind` on `bytes` over `axes`, with its cost
/// and the participating axes (given order, and fastest first).
fn choose(
    kind: Collective,
    bytes: f64,
    axes: &[usize],
    links: &Links,
) -> (Algorithm, f64, Axes, Axes) {
    let mut given = Axes::new();
    for &a in axes.iter().filter(|&&a| links.shape[a] > 1) {
        given.push(a);
    }
    let mut sorted = given;
    let bw = links.bandwidth_bytes_per_s;
    sorted.items[..sorted.len].sort_by(|&x, &y| bw[y].total_cmp(&bw[x]).then(x.cmp(&y)));
    let k = given.len;
    let cost_of = |alg: Algorithm| {
        let mut total = 0.0;
        for_each_step(
            kind,
            alg,
            bytes,
            &given,
            &sorted,
            links.shape,
            &mut |kd, ax, b| total += links.ring_s(kd, b, ax),
        );
        total
    };
    let mut best = (Algorithm::Flat, cost_of(Algorithm::Flat));
    let mut consider = |alg: Algorithm| {
        let cost = cost_of(alg);
        if cost < best.1 {
            best = (alg, cost);
        }
    };
    if k >= 2 {
        if kind == Collective::AllReduce {
            // Scattering along every axis is never better than all-reducing the
            // last one (same bytes, one latency less); no scatter + joint is flat.
            for scatter in 0..(1u32 << k) - 1 {
                let rest = k - scatter.count_ones() as usize;
                if scatter != 0 {
                    consider(Algorithm::ScatterReduceGather {
                        scatter,
                        joint: true,
                    });
                }
                if rest >= 2 {
                    consider(Algorithm::ScatterReduceGather {
                        scatter,
                        joint: false,
                    });
                }
            }
        } else {
            consider(Algorithm::PerAxis);
        }
    }
    (best.0, best.1, given, sorted)
}

/// Time in seconds of one collective over the devices along `axes` (axes of
/// size 1 take no part): the cheapest algorithm's (see the module docs).
pub fn collective_cost_s(kind: Collective, bytes: f64, axes: &[usize], links: &Links) -> f64 {
    choose(kind, bytes, axes, links).1
}

/// The cheapest algorithm's steps and cost (the same choice as `collective_cost_s`).
pub fn collective_plan(
    kind: Collective,
    bytes: f64,
    axes: &[usize],
    links: &Links,
) -> CollectivePlan {
    let (alg, cost_s, given, sorted) = choose(kind, bytes, axes, links);
    let mut steps = Vec::new();
    for_each_step(
        kind,
        alg,
        bytes,
        &given,
        &sorted,
        links.shape,
        &mut |kd, ax, b| {
            steps.push(CollectiveStep {
                kind: kd,
                axes: ax.to_vec(),
                bytes: b,
                cost_s: links.ring_s(kd, b, ax),
            })
        },
    );
    CollectivePlan {
        kind,
        bytes,
        steps,
        cost_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KINDS: [Collective; 5] = [
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllReduce,
        Collective::AllToAll,
        Collective::Broadcast,
    ];

    struct Mesh {
        shape: Vec<usize>,
        alpha_s: Vec<f64>,
        bw: Vec<f64>,
    }

    impl Mesh {
        fn links(&self) -> Links<'_> {
            Links {
                shape: &self.shape,
                alpha_s: &self.alpha_s,
                bandwidth_bytes_per_s: &self.bw,
                reduce_scatter_as_all_reduce: false,
            }
        }
    }

    /// The 2x4 mesh: a slow axis 0 (20 us, 25 GB/s) and a fast axis 1 (5 us, 200 GB/s).
    fn two_by_four() -> Mesh {
        Mesh {
            shape: vec![2, 4],
            alpha_s: vec![2e-5, 5e-6],
            bw: vec![2.5e10, 2e11],
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-9)
    }

    fn summary(plan: &CollectivePlan) -> Vec<(&'static str, Vec<usize>, f64)> {
        plan.steps
            .iter()
            .map(|s| (s.kind.name(), s.axes.clone(), s.bytes))
            .collect()
    }

    #[test]
    fn hierarchical_all_reduce_wins_on_two_by_four() {
        let m = two_by_four();
        let b = 4.98e8; // GPT-2 small's fp32 gradients
        let plan = collective_plan(Collective::AllReduce, b, &[0, 1], &m.links());
        // Reduce-scatter inside the fast axis, all-reduce a quarter across the slow one.
        assert_eq!(
            summary(&plan),
            vec![
                ("reduce_scatter", vec![1], b),
                ("all_reduce", vec![0], b / 4.0),
                ("all_gather", vec![1], b),
            ]
        );
        let inner = 0.75 * b / 2e11 + 5e-6;
        let outer = 2.0 * 0.5 * (b / 4.0) / 2.5e10 + 2e-5;
        assert!(close(plan.cost_s, 2.0 * inner + outer));
        assert!((plan.cost_s - 8.7e-3).abs() < 0.1e-3, "{}", plan.cost_s);
        let flat = 2.0 * 7.0 / 8.0 * b / 2.5e10 + 2e-5;
        assert!((flat - 34.9e-3).abs() < 0.1e-3);
        assert!(close(
            collective_cost_s(Collective::AllReduce, b, &[1, 0], &m.links()),
            plan.cost_s
        ));
    }

    #[test]
    fn flat_wins_on_equal_links_and_when_latency_bound() {
        // Equal links: the chain moves the same bytes as the ring, with more latencies.
        let m = Mesh {
            shape: vec![2, 4],
            alpha_s: vec![1e-5; 2],
            bw: vec![1e11; 2],
        };
        for kind in KINDS {
            for b in [8.0, 1e6, 1e9] {
                let plan = collective_plan(kind, b, &[0, 1], &m.links());
                assert!(plan.is_flat(), "{kind:?} {b}");
                assert_eq!(plan.steps[0].axes, vec![0, 1]);
            }
        }
        // Unequal links, but 64 bytes: latency decides, one ring pays one latency.
        let m = two_by_four();
        let plan = collective_plan(Collective::AllReduce, 64.0, &[0, 1], &m.links());
        assert!(plan.is_flat());
        assert!(close(plan.cost_s, 2.0 * 7.0 / 8.0 * 64.0 / 2.5e10 + 2e-5));
    }

    #[test]
    fn gathers_and_scatters_put_the_fast_axis_on_the_big_buffer() {
        let m = two_by_four();
        let b = 1e8;
        let rs = collective_plan(Collective::ReduceScatter, b, &[0, 1], &m.links());
        assert_eq!(
            summary(&rs),
            vec![
                ("reduce_scatter", vec![1], b),
                ("reduce_scatter", vec![0], b / 4.0)
            ]
        );
        let ag = collective_plan(Collective::AllGather, b, &[0, 1], &m.links());
        assert_eq!(
            summary(&ag),
            vec![("all_gather", vec![0], b / 4.0), ("all_gather", vec![1], b)]
        );
        let want = 0.75 * b / 2e11 + 5e-6 + 0.5 * (b / 4.0) / 2.5e10 + 2e-5;
        assert!(close(rs.cost_s, want) && close(ag.cost_s, want));
        let a2a = collective_plan(Collective::AllToAll, b, &[0, 1], &m.links());
        assert_eq!(
            summary(&a2a),
            vec![("all_to_all", vec![1], b), ("all_to_all", vec![0], b)]
        );
    }

    #[test]
    fn a_backend_that_reduce_scatters_by_all_reduce_pays_for_one() {
        // gloo all-reduces a reduce-scatter's whole input: each scatter step
        // costs an all-reduce of its bytes; the steps themselves are unchanged.
        let m = two_by_four();
        let mut gloo = m.links();
        gloo.reduce_scatter_as_all_reduce = true;
        let b = 1e8;
        let rs = collective_plan(Collective::ReduceScatter, b, &[0, 1], &gloo);
        assert_eq!(
            summary(&rs),
            vec![
                ("reduce_scatter", vec![1], b),
                ("reduce_scatter", vec![0], b / 4.0)
            ]
        );
        let want = 1.5 * b / 2e11 + 5e-6 + (b / 4.0) / 2.5e10 + 2e-5;
        assert!(close(rs.cost_s, want));
        assert!(close(
            collective_cost_s(Collective::ReduceScatter, b, &[1], &gloo),
            collective_cost_s(Collective::AllReduce, b, &[1], &m.links())
        ));
        // An all-reduce's scatter steps cost more there: never cheaper than before.
        for kind in KINDS {
            let before = collective_cost_s(kind, b, &[0, 1], &m.links());
            assert!(collective_cost_s(kind, b, &[0, 1], &gloo) >= before);
        }
    }

    #[test]
    fn three_axes_can_reduce_the_rest_jointly() {
        // Axis 2 fast; axes 0 and 1 equally slow: scatter along 2, then one ring
        // over 0 and 1 (one latency) beats two all-reduces there.
        let m = Mesh {
            shape: vec![2, 2, 4],
            alpha_s: vec![1e-4, 1e-4, 1e-6],
            bw: vec![1e10, 1e10, 1e12],
        };
        let b = 1e6;
        let plan = collective_plan(Collective::AllReduce, b, &[0, 1, 2], &m.links());
        assert_eq!(
            summary(&plan),
            vec![
                ("reduce_scatter", vec![2], b),
                ("all_reduce", vec![0, 1], b / 4.0),
                ("all_gather", vec![2], b),
            ]
        );
    }

    #[test]
    fn size_one_axes_and_single_axes_are_flat() {
        let m = Mesh {
            shape: vec![1, 4],
            alpha_s: vec![1.0, 1e-5],
            bw: vec![1.0, 1e9],
        };
        let plan = collective_plan(Collective::AllReduce, 1e6, &[0, 1], &m.links());
        assert_eq!(summary(&plan), vec![("all_reduce", vec![1], 1e6)]);
        assert!(close(plan.cost_s, 1.5 * 1e6 / 1e9 + 1e-5));
        let none = collective_plan(Collective::AllGather, 1e6, &[0], &m.links());
        assert!(none.steps.is_empty() && none.cost_s == 0.0);
    }

    /// Every candidate of the search, priced alone.
    fn all_candidates(kind: Collective, bytes: f64, axes: &[usize], links: &Links) -> Vec<f64> {
        let (_, _, given, sorted) = choose(kind, bytes, axes, links);
        let k = given.len;
        let mut algs = vec![Algorithm::Flat, Algorithm::PerAxis];
        if kind == Collective::AllReduce {
            algs.pop();
            for scatter in 0..(1u32 << k) {
                for joint in [true, false] {
                    algs.push(Algorithm::ScatterReduceGather { scatter, joint });
                }
            }
        }
        algs.iter()
            .map(|&alg| {
                let mut t = 0.0;
                for_each_step(
                    kind,
                    alg,
                    bytes,
                    &given,
                    &sorted,
                    links.shape,
                    &mut |kd, ax, b| t += links.ring_s(kd, b, ax),
                );
                t
            })
            .collect()
    }

    /// Every ordering of the per-axis chain (not only fastest first), priced by hand.
    fn chain_orders(kind: Collective, bytes: f64, axes: &[usize], links: &Links) -> Vec<f64> {
        let live: Vec<usize> = axes
            .iter()
            .copied()
            .filter(|&a| links.shape[a] > 1)
            .collect();
        let mut out = Vec::new();
        permute(&mut live.clone(), 0, &mut |order| {
            let mut b = bytes;
            let mut t = 0.0;
            for &a in order {
                t += links.ring_s(kind, b, &[a]);
                if kind == Collective::ReduceScatter {
                    b /= links.shape[a] as f64;
                }
            }
            out.push(t);
        });
        out
    }

    fn permute(v: &mut Vec<usize>, i: usize, f: &mut impl FnMut(&[usize])) {
        if i == v.len() {
            f(v);
            return;
        }
        for j in i..v.len() {
            v.swap(i, j);
            permute(v, i + 1, f);
            v.swap(i, j);
        }
    }

    fn meshes() -> impl Strategy<Value = (Vec<usize>, Vec<f64>, Vec<f64>)> {
        (1usize..=4).prop_flat_map(|k| {
            (
                proptest::collection::vec(1usize..=4, k),
                proptest::collection::vec(0.0f64..1e-4, k),
                proptest::collection::vec(1e8f64..1e12, k),
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn chosen_cost_is_the_cheapest_candidate(
            (shape, alpha_s, bw) in meshes(),
            kind in 0usize..5,
            log_bytes in 0.0f64..10.0,
            reverse in any::<bool>(),
        ) {
            let m = Mesh { shape, alpha_s, bw };
            let links = m.links();
            let kind = KINDS[kind];
            let bytes = 10f64.powf(log_bytes);
            let mut axes: Vec<usize> = (0..m.shape.len()).collect();
            if reverse {
                axes.reverse();
            }
            let plan = collective_plan(kind, bytes, &axes, &links);
            let candidates = all_candidates(kind, bytes, &axes, &links);
            let least = candidates.iter().copied().fold(f64::INFINITY, f64::min);
            prop_assert!(close(plan.cost_s, least), "{} vs {}", plan.cost_s, least);
            prop_assert!(close(plan.cost_s, plan.steps.iter().map(|s| s.cost_s).sum::<f64>()));
            prop_assert!(close(plan.cost_s, collective_cost_s(kind, bytes, &axes, &links)));
            // Fastest first is the best order of a per-axis chain.
            if matches!(kind, Collective::ReduceScatter | Collective::AllToAll) {
                let best_order = chain_orders(kind, bytes, &axes, &links)
                    .into_iter().fold(f64::INFINITY, f64::min);
                prop_assert!(plan.cost_s <= best_order * (1.0 + 1e-12));
            }
            // The reduced share is what the scatter steps leave.
            let mut scattered = 1.0;
            for s in &plan.steps {
                if s.kind == Collective::AllReduce && plan.steps.len() > 1 {
                    prop_assert!(close(s.bytes, bytes / scattered));
                }
                if s.kind == Collective::ReduceScatter {
                    scattered *= s.axes.iter().map(|&a| m.shape[a] as f64).product::<f64>();
                }
            }
        }
    }
}
