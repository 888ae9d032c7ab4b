//! A reproducible transformer-like chain, shared by the benches and the tests.

use super::{Chain, RotorError, Stage};

/// A fixed pseudo-random chain of `len` stages (xorshift, no extra dependency) with the
/// spread of a transformer-like network: activations of 8-64 MiB, saved sets
/// 2-5x larger, milliseconds of compute, collectives on one stage in three.
/// (`len` 0 is an error: a chain has at least one stage.)
pub fn example_chain(len: usize) -> Result<Chain, RotorError> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ len as u64;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    const MIB: u64 = 1 << 20;
    let stages = (0..len)
        .map(|k| {
            let out = (8 + next(57)) * MIB;
            let fwd = 1e-3 * (1.0 + next(40) as f64 / 10.0);
            let comm = k % 3 == 0;
            Stage {
                fwd_compute_s: fwd,
                fwd_comm_s: if comm { 2e-4 } else { 0.0 },
                bwd_compute_s: 2.0 * fwd,
                bwd_comm_s: if comm { 2e-4 } else { 0.0 },
                fwd_tmp_bytes: next(8) * MIB,
                fwd_comm_tmp_bytes: if comm { out / 2 } else { 0 },
                save_fwd_tmp_bytes: None,
                bwd_tmp_bytes: out,
                bwd_comm_tmp_bytes: if comm { out / 2 } else { 0 },
                out_bytes: out,
                saved_bytes: out * (2 + next(4)),
                out_grad_bytes: out,
                param_grad_bytes: 0,
                frees_input: false,
            }
        })
        .collect();
    Chain::new(stages, 32 * MIB, 0)
}
