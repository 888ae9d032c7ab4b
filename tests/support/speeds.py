"""Device speeds for tests that plan on every rank. Speeds left out are
measured in each process, and measurements differ between processes: ranks
that plan alone must be given every speed to agree on one plan. Memory
traffic and kernel overheads are made negligible, so the FLOP rate decides
as in the tests' designs."""

from __future__ import annotations


def speeds(flops_per_s: float) -> dict[str, float]:
    return {"flops_per_s": flops_per_s, "memory_bandwidth_bytes_per_s": 1e15,
            "op_overhead_s": 1e-12}


#: An A100-class FLOP rate: compute is cheap next to the links (plans replicate).
FAST = speeds(100e12)
