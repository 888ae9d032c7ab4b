//! Tests of the rotor solver: the dynamic program against an exhaustive
//! search over every schedule of the model (all of which are persistent, see
//! the module docs), replays of the recovered schedules, and the API.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use proptest::prelude::*;

use super::schedule::{ops_of_blocks, replay, State};
use super::sizes::Sizes;
use super::solve::{min_budget_bytes, solve, solve_full, solve_with_threads};
use super::*;

/// f64 with a total order, for the heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key(f64);
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Key {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

fn all_ops(l: usize) -> Vec<Op> {
    (0..l)
        .flat_map(|k| {
            [
                Op::ForwardNoSave(k),
                Op::ForwardCheckpoint(k),
                Op::ForwardSaveAll(k),
                Op::Backward(k),
            ]
        })
        .collect()
}

/// Dijkstra over the live-tensor states of the model: the least time of any
/// op sequence from the start to δ_0 whose every op stays within `budget`
/// (the same units as `sz`), or None.
fn brute_force_time(sz: &Sizes, fwd: &[f64], bwd: &[f64], budget: u64) -> Option<f64> {
    let start = State::new(sz);
    if start.mem > budget {
        return None;
    }
    let ops = all_ops(sz.len());
    let mut dist: HashMap<State, f64> = HashMap::new();
    let mut heap = BinaryHeap::new();
    dist.insert(start.clone(), 0.0);
    heap.push(Reverse((Key(0.0), start)));
    while let Some(Reverse((Key(d), state))) = heap.pop() {
        if d > dist[&state] {
            continue;
        }
        if state.backward_from == 0 {
            return Some(d);
        }
        for op in &ops {
            let mut next = state.clone();
            let Ok(during) = next.apply(sz, *op) else {
                continue;
            };
            if during > budget {
                continue;
            }
            let nd = d + match op {
                Op::Backward(k) => bwd[*k],
                _ => fwd[op.stage()],
            };
            if dist.get(&next).is_none_or(|&old| nd < old) {
                dist.insert(next.clone(), nd);
                heap.push(Reverse((Key(nd), next)));
            }
        }
    }
    None
}

/// The least peak memory of any complete op sequence (bottleneck Dijkstra).
fn brute_force_min_peak(sz: &Sizes) -> u64 {
    let start = State::new(sz);
    let ops = all_ops(sz.len());
    let mut best: HashMap<State, u64> = HashMap::new();
    let mut heap = BinaryHeap::new();
    best.insert(start.clone(), start.mem);
    heap.push(Reverse((start.mem, start)));
    while let Some(Reverse((p, state))) = heap.pop() {
        if p > best[&state] {
            continue;
        }
        if state.backward_from == 0 {
            return p;
        }
        for op in &ops {
            let mut next = state.clone();
            let Ok(during) = next.apply(sz, *op) else {
                continue;
            };
            let np = p.max(during);
            if best.get(&next).is_none_or(|&old| np < old) {
                best.insert(next.clone(), np);
                heap.push(Reverse((np, next)));
            }
        }
    }
    unreachable!("saving everything always completes")
}

fn times(chain: &Chain) -> (Vec<f64>, Vec<f64>) {
    (
        chain.stages().iter().map(|s| s.fwd_s()).collect(),
        chain.stages().iter().map(|s| s.bwd_s()).collect(),
    )
}

fn store_all_ops(l: usize) -> Vec<Op> {
    (0..l)
        .map(Op::ForwardSaveAll)
        .chain((0..l).rev().map(Op::Backward))
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1e-3)
}

fn arb_stage() -> impl Strategy<Value = Stage> {
    (
        (
            0.0..1.0f64,
            0.0..1.0f64,
            0.0..1.0f64,
            0.0..1.0f64,
            any::<bool>(),
        ),
        (0u64..5, 0u64..3, 0u64..5, 0u64..3),
        (
            0u64..8,
            0u64..8,
            0u64..8,
            any::<bool>(),
            0u64..4,
            any::<bool>(),
        ),
    )
        .prop_map(
            |((fc, fm, bc, bm, comm), (ft, fct, bt, bct), (out, extra, g, same, pg, frees))| {
                Stage {
                    fwd_compute_s: fc,
                    fwd_comm_s: if comm { fm } else { 0.0 },
                    bwd_compute_s: bc,
                    bwd_comm_s: if comm { bm } else { 0.0 },
                    fwd_tmp_bytes: ft,
                    fwd_comm_tmp_bytes: if comm { fct } else { 0 },
                    // A saving forward's own overhead in a quarter of the stages.
                    save_fwd_tmp_bytes: if pg == 1 { Some(ft / 2) } else { None },
                    bwd_tmp_bytes: bt,
                    bwd_comm_tmp_bytes: if comm { bct } else { 0 },
                    out_bytes: out,
                    saved_bytes: out + extra,
                    out_grad_bytes: if same { out } else { g },
                    // Parameter gradients in half the stages (they ride on δ).
                    param_grad_bytes: if pg >= 2 { pg - 1 } else { 0 },
                    frees_input: frees,
                }
            },
        )
}

fn arb_chain(max_len: usize) -> impl Strategy<Value = Chain> {
    (
        prop::collection::vec(arb_stage(), 1..=max_len),
        0u64..8,
        0u64..8,
    )
        .prop_map(|(stages, a0, g0)| Chain::new(stages, a0, g0).unwrap())
}

/// Everything a solved schedule must satisfy, whatever the slots.
fn check_solved(chain: &Chain, budget: u64, slots: usize) -> Result<f64, TestCaseError> {
    let solved = solve_full(chain, budget, slots, 1, usize::MAX).unwrap();
    let sch = &solved.schedule;
    let (fwd, bwd) = times(chain);
    // The replay agrees with the table and with the recurrence's memory.
    let in_slots = replay(&solved.sizes_in_slots, &fwd, &bwd, &sch.ops).unwrap();
    prop_assert!(close(in_slots.time_s, solved.table_time_s as f64));
    prop_assert_eq!(in_slots.peak_memory_bytes, solved.claimed_peak_slots);
    prop_assert!(in_slots.peak_memory_bytes <= slots as u64);
    let in_bytes = simulate(chain, &sch.ops).unwrap();
    prop_assert_eq!(in_bytes.peak_memory_bytes, sch.peak_memory_bytes);
    prop_assert!(sch.peak_memory_bytes <= budget);
    prop_assert_eq!(in_bytes.time_s, sch.predicted_time_s);
    prop_assert!(sch.predicted_time_s >= sch.no_recompute_time_s - 1e-9);
    // The nested checkpoint blocks execute exactly these ops.
    prop_assert_eq!(ops_of_blocks(chain.len(), &sch.blocks), sch.ops.clone());
    Ok(sch.predicted_time_s)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Acceptance 1: with one byte a slot the DP is exact; its optimum equals
    /// the exhaustive search over all schedules, feasibility agrees, and the
    /// least budget equals the least peak of any schedule.
    #[test]
    fn dp_equals_brute_force(chain in arb_chain(6), frac in 0.0..1.0f64) {
        let bytes = Sizes::bytes(&chain);
        let (fwd, bwd) = times(&chain);
        let min_peak = brute_force_min_peak(&bytes);
        prop_assert_eq!(min_budget_bytes(&chain), min_peak);
        let all_peak = simulate(&chain, &store_all_ops(chain.len())).unwrap().peak_memory_bytes;
        let budget = (min_peak as f64 - 1.0 + frac * (all_peak + 3 - min_peak) as f64)
            .max(1.0) as u64;
        let slots = budget as usize; // slot = 1 byte: no rounding
        match brute_force_time(&bytes, &fwd, &bwd, budget) {
            None => {
                prop_assert!(budget < min_peak);
                match solve(&chain, budget, slots) {
                    Err(RotorError::InfeasibleBudget { exact_min_budget_bytes, min_budget_bytes, .. }) => {
                        prop_assert_eq!(exact_min_budget_bytes, min_peak);
                        prop_assert!(min_budget_bytes >= min_peak);
                        prop_assert!(solve(&chain, min_budget_bytes, slots).is_ok());
                    }
                    other => prop_assert!(false, "expected infeasible, got {other:?}"),
                }
            }
            Some(best) => {
                let solved = solve_full(&chain, budget, slots, 1, usize::MAX).unwrap();
                prop_assert!(close(solved.table_time_s as f64, best),
                    "dp {} vs brute force {}", solved.table_time_s, best);
                let t = check_solved(&chain, budget, slots)?;
                prop_assert!(close(t, best), "replayed {} vs brute force {}", t, best);
            }
        }
    }

    /// With coarse slots the schedule stays feasible in bytes, is never
    /// better than the exact optimum, and matches its own replay.
    #[test]
    fn rounded_slots_stay_feasible(chain in arb_chain(6), frac in 0.0..1.5f64, slots in 1usize..40) {
        let bytes = Sizes::bytes(&chain);
        let (fwd, bwd) = times(&chain);
        let min_peak = min_budget_bytes(&chain);
        let budget = ((min_peak as f64) * (1.0 + frac)).max(1.0) as u64;
        match solve(&chain, budget, slots) {
            Ok(_) => {
                let t = check_solved(&chain, budget, slots)?;
                let best = brute_force_time(&bytes, &fwd, &bwd, budget).unwrap();
                prop_assert!(t >= best - 1e-9);
            }
            Err(RotorError::InfeasibleBudget { min_budget_bytes, exact_min_budget_bytes, .. }) => {
                prop_assert_eq!(exact_min_budget_bytes, min_peak);
                prop_assert!(min_budget_bytes > budget);
                prop_assert!(solve(&chain, min_budget_bytes, slots).is_ok());
                prop_assert!(solve(&chain, min_budget_bytes - 1, slots).is_err());
            }
            // Too few slots for the tensors live at once, whatever the budget.
            Err(RotorError::InvalidChain(msg)) => {
                prop_assert!(msg.contains("memory slots cannot hold"), "{}", msg);
                prop_assert!(solve(&chain, u64::MAX / 4, slots).is_err());
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }

    /// Threads split cells of one length; the table must not change.
    #[test]
    fn parallel_fill_is_identical(chain in arb_chain(30), slots in 20usize..200) {
        let budget = min_budget_bytes(&chain) * 2 + 1;
        let a = solve_full(&chain, budget, slots, 1, usize::MAX);
        let b = solve_full(&chain, budget, slots, 3, 0);
        match (a, b) {
            (Ok(a), Ok(b)) => {
                prop_assert_eq!(a.table_time_s.to_bits(), b.table_time_s.to_bits());
                prop_assert_eq!(a.schedule, b.schedule);
            }
            (Err(a), Err(b)) => prop_assert_eq!(a, b),
            (a, b) => prop_assert!(false, "{a:?} vs {b:?}"),
        }
    }
}

fn uniform_stage(fwd: f64, bwd: f64, out: u64, saved: u64) -> Stage {
    Stage {
        fwd_compute_s: fwd,
        bwd_compute_s: bwd,
        out_bytes: out,
        saved_bytes: saved,
        out_grad_bytes: out,
        ..Stage::default()
    }
}

/// A stage that keeps only a copy of its input lets the output of the
/// checkpointed region before it go: the same schedule needs less memory, and
/// a budget only that saving admits keeps stage 1's activations.
#[test]
fn a_stage_freeing_its_input_lowers_the_schedule_after_a_region() {
    // Stage 0's saved set is large: checkpointing it is the way down.
    let stages = |frees: bool| {
        let mut v = vec![
            uniform_stage(1.0, 2.0, 10, 45),
            uniform_stage(1.0, 2.0, 10, 20),
            uniform_stage(1.0, 2.0, 10, 20),
        ];
        v[1].frees_input = frees;
        Chain::new(v, 10, 0).unwrap()
    };
    let (keeps, frees) = (stages(false), stages(true));
    assert!(min_budget_bytes(&frees) <= min_budget_bytes(&keeps));
    // The least budget of the kept-input chain that checkpoints stage 0 alone.
    let ck0 = [
        Op::ForwardCheckpoint(0),
        Op::ForwardSaveAll(1),
        Op::ForwardSaveAll(2),
        Op::Backward(2),
        Op::Backward(1),
        Op::ForwardSaveAll(0),
        Op::Backward(0),
    ];
    let kept = simulate(&keeps, &ck0).unwrap().peak_memory_bytes;
    let freed = simulate(&frees, &ck0).unwrap().peak_memory_bytes;
    assert_eq!(
        kept - freed,
        10,
        "a_1 (10 B) is not held through stages 1-2"
    );
    let sch = solve(&frees, freed, freed as usize).unwrap();
    assert_eq!(sch.ops, ck0.to_vec());
    assert_eq!(sch.peak_memory_bytes, freed);
    assert!(solve(&keeps, freed, freed as usize).map_or(true, |s| s.ops != ck0.to_vec()));
    // The first stage never lets the chain input go.
    let mut first = vec![uniform_stage(1.0, 2.0, 10, 20); 2];
    first[0].frees_input = true;
    let first = Chain::new(first, 10, 0).unwrap();
    let all = simulate(&first, &store_all_ops(2)).unwrap();
    assert_eq!(all.memory_after_bytes[0], 10 + 10 + 20);
}

#[test]
fn generous_budget_saves_everything() {
    let chain = Chain::new(vec![uniform_stage(1.0, 2.0, 10, 30); 4], 10, 0).unwrap();
    let sch = solve(&chain, 1_000, 1_000).unwrap();
    assert_eq!(sch.ops, store_all_ops(4));
    assert!(sch.blocks.is_empty());
    assert_eq!(sch.predicted_time_s, 12.0);
    assert_eq!(sch.recompute_time_s(), 0.0);
    // a_0 + ā_1..ā_4 + δ_4, then the first backward adds δ_3.
    assert_eq!(sch.peak_memory_bytes, 10 + 4 * 30 + 10 + 10);
}

#[test]
fn tight_budget_recomputes_inside_checkpoint_blocks() {
    let chain = Chain::new(vec![uniform_stage(1.0, 2.0, 10, 30); 4], 10, 0).unwrap();
    let store_all = 150;
    let sch = solve(&chain, 100, 100).unwrap();
    assert!(sch.peak_memory_bytes <= 100 && sch.peak_memory_bytes < store_all);
    assert!(sch.predicted_time_s > 12.0);
    assert!(!sch.blocks.is_empty());
    assert_eq!(ops_of_blocks(4, &sch.blocks), sch.ops);
    let recomputed = sch.ops.iter().filter(|o| o.is_forward()).count() - 4;
    assert_eq!(sch.recompute_time_s(), recomputed as f64);
}

#[test]
fn communication_time_is_paid_by_every_recomputation() {
    let mut stage = uniform_stage(1.0, 2.0, 10, 30);
    stage.fwd_comm_s = 0.5;
    stage.bwd_comm_s = 0.25;
    let chain = Chain::new(vec![stage; 4], 10, 0).unwrap();
    let sch = solve(&chain, 100, 100).unwrap();
    let forwards = sch.ops.iter().filter(|o| o.is_forward()).count() as f64;
    assert_eq!(sch.predicted_time_s, forwards * 1.5 + 4.0 * 2.25);
}

#[test]
fn backward_temporaries_are_read_from_the_backward_fields() {
    // A large backward temporary must count only during backwards, a large
    // forward one only during forwards (the original MAP solver mixed them).
    let mut st = uniform_stage(1.0, 1.0, 1, 1);
    st.bwd_tmp_bytes = 50;
    let chain = Chain::new(vec![st.clone()], 0, 0).unwrap();
    // backward: ā_1 + δ_1 + δ_0 (0) + 50
    assert_eq!(min_budget_bytes(&chain), 1 + 1 + 50);
    st.bwd_tmp_bytes = 0;
    st.fwd_comm_tmp_bytes = 50;
    let chain = Chain::new(vec![st], 0, 0).unwrap();
    // forward: δ_1 + ā_1 + 50
    assert_eq!(min_budget_bytes(&chain), 1 + 1 + 50);
}

#[test]
fn a_saving_forward_counts_its_own_overhead() {
    // A stage whose forward gathers a 20-byte weight it saves: the forward
    // that saves nothing holds the copy transiently (fwd_tmp 20), the saving
    // one holds it in its saved set and needs nothing beyond (0).
    let mut st = uniform_stage(1.0, 1.0, 1, 21);
    st.fwd_tmp_bytes = 20;
    let both = Chain::new(vec![st.clone()], 0, 0).unwrap();
    // forward: δ_1 + ā_1 + 20 (the saved copy counted twice)
    assert_eq!(min_budget_bytes(&both), 1 + 21 + 20);
    st.save_fwd_tmp_bytes = Some(0);
    let own = Chain::new(vec![st], 0, 0).unwrap();
    // backward: ā_1 + δ_1 + δ_0 (0)
    assert_eq!(min_budget_bytes(&own), 21 + 1);
    let replay = simulate(&own, &store_all_ops(1)).unwrap();
    assert_eq!(replay.peak_memory_bytes, 21 + 1);
}

#[test]
fn infeasible_budget_says_what_is_needed() {
    let chain = Chain::new(vec![uniform_stage(1.0, 2.0, 10, 30); 4], 10, 0).unwrap();
    let need = min_budget_bytes(&chain);
    // One byte a slot at the least budget: no rounding, exactly feasible.
    assert!(solve(&chain, need, need as usize).is_ok());
    // One byte short, many slots: the exact minimum is the answer.
    let err = solve(&chain, need - 1, 100 * need as usize).unwrap_err();
    let RotorError::InfeasibleBudget {
        min_budget_bytes,
        exact_min_budget_bytes,
        ..
    } = err
    else {
        panic!("expected infeasible, got {err:?}");
    };
    assert_eq!(exact_min_budget_bytes, need);
    assert!(err
        .to_string()
        .starts_with(&format!("infeasible: the activation-checkpoint schedule needs at least {min_budget_bytes} bytes, the budget is {} bytes", need - 1)));
    assert!(solve(&chain, min_budget_bytes, 100 * need as usize).is_ok());
    // Coarse slots: the exact minimum fits in bytes but not once rounded;
    // the error names the least budget that fits at this slot count.
    match solve(&chain, need, 9) {
        Err(e @ RotorError::InfeasibleBudget { .. }) => {
            let RotorError::InfeasibleBudget {
                min_budget_bytes, ..
            } = e
            else {
                unreachable!()
            };
            assert!(min_budget_bytes > need);
            assert!(solve(&chain, min_budget_bytes, 9).is_ok());
            assert!(solve(&chain, min_budget_bytes - 1, 9).is_err());
            assert!(e
                .to_string()
                .contains(&format!("the least memory of any schedule is {need} bytes")));
        }
        other => panic!("expected infeasible at 9 slots, got {other:?}"),
    }
}

#[test]
fn invalid_chains_are_rejected() {
    let err = |r: Result<Chain, RotorError>| r.unwrap_err().to_string();
    assert_eq!(err(Chain::new(vec![], 0, 0)), "the chain has no stage");
    let mut st = uniform_stage(1.0, 1.0, 10, 5);
    assert!(err(Chain::new(vec![st.clone()], 0, 0)).contains("saved_bytes (5)"));
    st.saved_bytes = 10;
    st.fwd_comm_s = f64::NAN;
    assert!(err(Chain::new(vec![st.clone()], 0, 0)).contains("fwd_comm_s must be finite"));
    st.fwd_comm_s = 0.0;
    st.out_bytes = u64::MAX / 2;
    st.saved_bytes = u64::MAX / 2;
    assert!(err(Chain::new(vec![st.clone()], 0, 0)).contains("2^62"));
    st.out_bytes = 1;
    st.saved_bytes = 1;
    let chain = Chain::new(vec![st], 0, 0).unwrap();
    assert!(matches!(
        solve(&chain, 0, 10),
        Err(RotorError::InvalidChain(_))
    ));
    assert!(matches!(
        solve(&chain, 10, 0),
        Err(RotorError::InvalidChain(_))
    ));
}

#[test]
fn simulate_rejects_invalid_schedules() {
    let chain = Chain::new(vec![uniform_stage(1.0, 1.0, 1, 2); 2], 1, 0).unwrap();
    let bad = [Op::ForwardSaveAll(0), Op::Backward(0)];
    assert!(matches!(
        simulate(&chain, &bad),
        Err(RotorError::InvalidSchedule(_))
    ));
    let short = [
        Op::ForwardSaveAll(0),
        Op::ForwardSaveAll(1),
        Op::Backward(1),
    ];
    let e = simulate(&chain, &short).unwrap_err().to_string();
    assert!(e.contains("stops before the backward of stage 0"), "{e}");
}

#[test]
fn larger_chain_solves_with_threads() {
    let stages: Vec<Stage> = (0..60)
        .map(|k| uniform_stage(1.0 + (k % 3) as f64, 2.0, 10 + (k % 5) as u64, 40))
        .collect();
    let chain = Chain::new(stages, 10, 0).unwrap();
    let budget = min_budget_bytes(&chain) * 3;
    let a = solve_with_threads(&chain, budget, 300, 1).unwrap();
    let b = solve_with_threads(&chain, budget, 300, 2).unwrap();
    assert_eq!(a, b);
    assert!(a.peak_memory_bytes <= budget);
    assert_eq!(ops_of_blocks(60, &a.blocks), a.ops);
}

/// The chain of `benches/rotor.rs`, with a budget 2/5 of the way from the
/// least feasible to the store-everything peak.
fn bench_chain(len: usize) -> (Chain, u64) {
    let chain = super::example_chain(len).unwrap();
    let max = simulate(&chain, &store_all_ops(len))
        .unwrap()
        .peak_memory_bytes;
    let min = min_budget_bytes(&chain);
    (chain, min + (max - min) * 2 / 5)
}

/// CPU seconds of this process (utime + stime, from /proc).
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

/// Timing on a loaded machine: CPU time of one thread, and the work count.
/// `cargo test --release --lib rotor::tests::time_solver -- --ignored --nocapture`
#[test]
#[ignore]
fn time_solver() {
    let threads: usize = std::env::var("ROTOR_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for (len, reps) in [(100, 50), (400, 2)] {
        let (chain, budget) = bench_chain(len);
        super::table::WORK.store(0, std::sync::atomic::Ordering::Relaxed);
        let (c0, w0) = (cpu_s(), std::time::Instant::now());
        let mut t = 0.0;
        for _ in 0..reps {
            t = solve_with_threads(&chain, budget, 500, 1)
                .unwrap()
                .predicted_time_s;
        }
        let work = super::table::WORK.load(std::sync::atomic::Ordering::Relaxed) / reps;
        println!(
            "L={len} M=500 {threads} thread(s): {:.1} ms cpu, {:.1} ms wall per solve, \
             {:.3e} updates, time {t:.6} s",
            1e3 * (cpu_s() - c0) / reps as f64,
            1e3 * w0.elapsed().as_secs_f64() / reps as f64,
            work as f64
        );
    }
}

/// A/B on a loaded machine, interleaved: blocked sequential fill vs the
/// by-length fill on 2 threads.
/// `cargo test --release --lib rotor::tests::time_fill_orders -- --ignored --nocapture`
#[test]
#[ignore]
fn time_fill_orders() {
    let (chain, budget) = bench_chain(400);
    for round in 0..3 {
        for (name, threads, par) in [
            ("blocked sequential", 1, usize::MAX),
            ("by length, 2 threads", 2, super::table::PAR_MIN_WORK),
        ] {
            let (c0, w0) = (cpu_s(), std::time::Instant::now());
            let sol = solve_full(&chain, budget, 500, threads, par).unwrap();
            println!(
                "round {round} {name:22}: {:.0} ms wall, {:.0} ms cpu, {:.6} s",
                1e3 * w0.elapsed().as_secs_f64(),
                1e3 * (cpu_s() - c0),
                sol.schedule.predicted_time_s
            );
        }
    }
}

/// The chain on which a schedule that recomputes part of a region before the
/// backward reaches it needs less memory (11 bytes) than the dynamic program
/// (12): gradients smaller than activations make early forwards cheaper. The
/// model forbids such schedules (recomputation is last in, first out, as in
/// nested `torch.utils.checkpoint`).
#[test]
fn early_recomputation_is_not_a_schedule() {
    let st = |out: u64, saved: u64, g: u64, ft: u64, bt: u64| Stage {
        out_bytes: out,
        saved_bytes: saved,
        out_grad_bytes: g,
        fwd_tmp_bytes: ft,
        bwd_tmp_bytes: bt,
        ..Stage::default()
    };
    let chain = Chain::new(
        vec![
            st(4, 4, 0, 0, 0),
            st(2, 2, 0, 4, 0),
            st(3, 3, 0, 0, 0),
            st(0, 1, 3, 4, 0),
            st(2, 3, 1, 0, 2),
        ],
        0,
        0,
    )
    .unwrap();
    use Op::*;
    let early = [
        ForwardCheckpoint(0),
        ForwardNoSave(1),
        ForwardNoSave(2),
        ForwardNoSave(3),
        ForwardCheckpoint(0), // recomputes below the live a_4
        ForwardNoSave(1),
        ForwardSaveAll(4),
        Backward(4),
    ];
    let err = simulate(&chain, &early).unwrap_err().to_string();
    assert!(err.contains("last in, first out"), "{err}");
    assert_eq!(min_budget_bytes(&chain), 12);
    assert_eq!(brute_force_min_peak(&Sizes::bytes(&chain)), 12);
}
