"""How often, and by how much, the exact layout search beats MAP's greedy
heuristic, over every ordered pair of valid specs on a 2x2x2 and a 4x4 mesh.

Links: the 2x2x2 mesh is the MAP paper's 8-GPU box (NVLink pairs inside,
PCIe inside a NUMA node, the slow link across NUMA); the 4x4 mesh is four
nodes of four GPUs (NVLink inside a node, 100 Gb/s network across).
Costs are training costs (forward + backward) in seconds.

    python benches/layout_optimal_vs_heuristic.py
"""

from __future__ import annotations

import statistics
import time

from automap import DeviceMesh, enumerate_specs, layout_path

CASES = [
    (
        "2x2x2 (paper's box)",
        DeviceMesh((2, 2, 2), alpha_s=[2e-5, 1e-5, 5e-6],
                   bandwidth_bytes_per_s=[10e9, 20e9, 200e9]),
        [[8, 1024, 1024], [4096, 4096], [64, 512, 768]],
    ),
    (
        "4x4 (4 nodes x 4 GPUs)",
        DeviceMesh((4, 4), alpha_s=[2e-5, 5e-6], bandwidth_bytes_per_s=[12.5e9, 100e9]),
        [[16, 1024, 1024], [4096, 4096], [64, 512, 768]],
    ),
]


def main() -> None:
    print(f"{'mesh':24} {'shape':18} {'pairs':>6} {'opt<heur':>9} {'mean x':>7} "
          f"{'median x':>9} {'max x':>7}")
    for name, mesh, shapes in CASES:
        all_ratios = []
        total_pairs = 0
        start = time.perf_counter()
        for shape in shapes:
            specs = enumerate_specs(shape, mesh)
            ratios = []
            for src in specs:
                for dst in specs:
                    opt = layout_path(mesh, src, dst, shape, 2)
                    heur = layout_path(mesh, src, dst, shape, 2, method="heuristic")
                    assert opt.cost_s <= heur.cost_s * (1 + 1e-12), (src, dst)
                    if opt.cost_s > 0:
                        ratios.append(heur.cost_s / opt.cost_s)
            better = [r for r in ratios if r > 1 + 1e-9]
            total_pairs += len(specs) ** 2
            all_ratios += ratios
            print(f"{name:24} {str(shape):18} {len(specs) ** 2:6d} "
                  f"{100 * len(better) / len(ratios):8.1f}% "
                  f"{statistics.mean(better or [1]):7.2f} {statistics.median(better or [1]):9.2f} "
                  f"{max(ratios):7.2f}")
        better = [r for r in all_ratios if r > 1 + 1e-9]
        print(f"{name:24} {'all':18} {total_pairs:6d} {100 * len(better) / len(all_ratios):8.1f}% "
              f"{statistics.mean(better):7.2f} {statistics.median(better):9.2f} "
              f"{max(all_ratios):7.2f}   ({time.perf_counter() - start:.1f} s)")
    print("opt<heur: share of pairs (with a non-zero cost) where the optimal path is strictly "
          "cheaper;\nx: heuristic cost / optimal cost over those pairs; never below 1 (asserted).")


if __name__ == "__main__":
    main()
