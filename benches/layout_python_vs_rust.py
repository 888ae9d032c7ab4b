"""Native layout search vs a plain pure-Python implementation of the same
search (benches/pure_python_layout.py: same A*, same moves, same costs), on
uncached pairs. Prints time per pair for both and the ratio.

    python benches/layout_python_vs_rust.py
"""

from __future__ import annotations

import random
import time

import automap
from automap import DeviceMesh, enumerate_specs, layout_path
from pure_python_layout import PyLayoutProblem, to_tuple_spec

CASES = [
    ("2x2x2 [64,64,64]",
     DeviceMesh((2, 2, 2), alpha_s=[1e-6, 5e-6, 2e-5], bandwidth_bytes_per_s=[2e11, 2e10, 1e10]),
     [64, 64, 64]),
    ("4x4 [1024,1024,64]",
     DeviceMesh((4, 4), alpha_s=[2e-6, 1e-5], bandwidth_bytes_per_s=[1e11, 1.25e10]),
     [1024, 1024, 64]),
]


def main(pairs_per_case: int = 2000) -> None:
    rng = random.Random(0)
    print(f"{'case':22} {'pairs':>6} {'python us/pair':>15} {'native us/pair':>15} {'ratio':>7} "
          f"{'native bulk us/pair':>20} {'ratio':>7}")
    for name, mesh, shape in CASES:
        specs = enumerate_specs(shape, mesh)
        pairs = [(rng.choice(specs), rng.choice(specs)) for _ in range(pairs_per_case)]
        ref = PyLayoutProblem(mesh.shape, mesh.alpha_s, mesh.bandwidth_bytes_per_s, shape, 4)
        tuple_pairs = [(to_tuple_spec(s), to_tuple_spec(d)) for s, d in pairs]

        start = time.perf_counter()
        py_costs = [ref.optimal_path(s, d)[0] for s, d in tuple_pairs]
        py_s = time.perf_counter() - start

        automap.clear_layout_cache()  # every pair is searched, none looked up
        start = time.perf_counter()
        native_costs = [layout_path(mesh, s, d, shape, 4).cost_s for s, d in pairs]
        native_s = time.perf_counter() - start
        assert all(abs(a - b) <= 1e-12 * max(a, 1e-12) for a, b in zip(py_costs, native_costs))

        # Bulk: a cost matrix over distinct rows and columns, all uncached, one call.
        rows, cols = specs[: len(specs) // 2], specs[len(specs) // 2:]
        automap.clear_layout_cache()
        start = time.perf_counter()
        automap.resharding_cost_matrix(mesh, rows, cols, shape, 4)
        bulk_s = (time.perf_counter() - start) / (len(rows) * len(cols))

        n = len(pairs)
        print(f"{name:22} {n:6d} {1e6 * py_s / n:15.1f} {1e6 * native_s / n:15.1f} "
              f"{py_s / native_s:6.1f}x {1e6 * bulk_s:20.2f} {py_s / n / bulk_s:6.0f}x")
    print("native: one layout_path call per pair, including the conversion of the path to Python "
          "objects;\nnative bulk: one resharding_cost_matrix call, uncached, per pair searched")


if __name__ == "__main__":
    main()
