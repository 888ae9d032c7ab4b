"""A plain pure-Python implementation of automap's rotor checkpointing DP (the
same recurrence, memory model and slot rounding as rust/rotor/: Theorem 5.1 of
the MAP paper with communication overheads), written for the benchmark that
measures the native solver against it. Dense table, f64, no pruning."""

from __future__ import annotations

import math

STAGE_FIELDS = (
    "fwd_compute_s", "fwd_comm_s", "bwd_compute_s", "bwd_comm_s",
    "fwd_tmp_bytes", "fwd_comm_tmp_bytes", "bwd_tmp_bytes", "bwd_comm_tmp_bytes",
    "out_bytes", "saved_bytes", "out_grad_bytes",
)


def optimal_time_s(stages: list[dict], input_bytes: int, input_grad_bytes: int,
                   budget_bytes: int, slots: int) -> float:
    """The optimal time of a persistent schedule within `budget_bytes`
    (math.inf when none fits). Sizes take ceil(bytes * slots / budget) slots."""

    def sl(x: int) -> int:
        return -(-x * slots // budget_bytes)

    n = len(stages)
    act = [sl(input_bytes)] + [sl(s["out_bytes"]) for s in stages]
    grad = [sl(input_grad_bytes)] + [sl(s["out_grad_bytes"]) for s in stages]
    saved = [sl(s["saved_bytes"]) for s in stages]
    ftmp = [sl(s["fwd_tmp_bytes"] + s["fwd_comm_tmp_bytes"]) for s in stages]
    btmp = [sl(s["bwd_tmp_bytes"] + s["bwd_comm_tmp_bytes"]) for s in stages]
    fwd = [s["fwd_compute_s"] + s["fwd_comm_s"] for s in stages]
    bwd = [s["bwd_compute_s"] + s["bwd_comm_s"] for s in stages]
    mmax = slots - act[0]
    if mmax < 0:
        return math.inf
    inf = math.inf
    table: dict[tuple[int, int], list[float]] = {}
    for d in range(n):
        for s in range(n - d):
            t = s + d
            row = [inf] * (mmax + 1)
            # Save everything of stage s, process (s+1, t), backward s.
            thr = max(grad[t + 1] + saved[s] + ftmp[s], saved[s] + grad[s + 1] + grad[s] + btmp[s])
            fb = fwd[s] + bwd[s]
            if s == t:
                for m in range(thr, mmax + 1):
                    row[m] = fb
            else:
                sub, sv = table[(s + 1, t)], saved[s]
                for m in range(max(thr, sv), mmax + 1):
                    v = fb + sub[m - sv]
                    if v < row[m]:
                        row[m] = v
            # Checkpoint a_s, sweep forward to a_j, process (j, t), then (s, j-1).
            f = 0.0
            sweep = 0
            for j in range(s + 1, t + 1):
                k = j - 1
                f += fwd[k]
                if k == s:
                    req = grad[t + 1] + act[s + 1] + ftmp[s]
                else:
                    req = grad[t + 1] + act[k] + act[k + 1] + ftmp[k]
                sweep = max(sweep, req)
                if sweep > mmax:
                    break
                right, left, aj = table[(j, t)], table[(s, j - 1)], act[j]
                for m in range(max(sweep, aj), mmax + 1):
                    v = f + right[m - aj] + left[m]
                    if v < row[m]:
                        row[m] = v
            table[(s, t)] = row
    return table[(0, n - 1)][mmax]


def bench_chain(n: int) -> tuple[list[dict], int]:
    """The chain of benches/rotor.rs (same xorshift generator) and its input bytes."""
    mask = (1 << 64) - 1
    x = (0x9E3779B97F4A7C15 ^ n) & mask

    def nxt(k: int) -> int:
        nonlocal x
        x ^= (x << 13) & mask
        x ^= x >> 7
        x ^= (x << 17) & mask
        return x % k

    mib = 1 << 20
    stages = []
    for k in range(n):
        out = (8 + nxt(57)) * mib
        fwd = 1e-3 * (1.0 + nxt(40) / 10.0)
        comm = k % 3 == 0
        stages.append({
            "fwd_compute_s": fwd,
            "fwd_comm_s": 2e-4 if comm else 0.0,
            "bwd_compute_s": 2.0 * fwd,
            "bwd_comm_s": 2e-4 if comm else 0.0,
            "fwd_tmp_bytes": nxt(8) * mib,
            "fwd_comm_tmp_bytes": out // 2 if comm else 0,
            "bwd_tmp_bytes": out,
            "bwd_comm_tmp_bytes": out // 2 if comm else 0,
            "out_bytes": out,
            "saved_bytes": out * (2 + nxt(4)),
            "out_grad_bytes": out,
        })
    return stages, 32 * mib
