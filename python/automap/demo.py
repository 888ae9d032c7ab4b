"""`automap demo`: the README's main command. Until the planner lands it shows
the foundation at work: on 4 gloo ranks of this machine (a 2x2 mesh) it
converts a tensor through a chain of sharding specs with the optimal layout
paths, checks every rank's shard and the gradient against the serial tensor,
and prints each path's steps, predicted cost and measured time."""

from __future__ import annotations

import time

import torch

from automap import DeviceMesh, ShardingSpec, layout_path
from automap.launch import run_on_gloo
from automap.redistribute import redistribute

CHAIN = ["RR", "S0R", "S01R", "RS10", "S1S0", "RS0", "RR"]
SHAPE = [512, 256]


def _rank_main(rank: int, world: int, mesh_dict: dict) -> list[dict]:
    mesh = DeviceMesh.from_dict(mesh_dict)
    groups = mesh.process_groups()
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    rows = []
    for src, dst in zip(CHAIN, CHAIN[1:]):
        s, d = ShardingSpec.parse(src), ShardingSpec.parse(dst)
        path = layout_path(mesh, s, d, SHAPE)
        mine = tuple(slice(a, b) for a, b in s.local_slices(SHAPE, mesh, rank))
        want = tuple(slice(a, b) for a, b in d.local_slices(SHAPE, mesh, rank))
        timings = []
        for _ in range(4):  # the first run connects the groups: not timed
            x = full[mine].clone().requires_grad_(True)
            start = time.perf_counter()
            y = redistribute(x, path, groups)
            y.backward(full[want])
            timings.append(time.perf_counter() - start)
        seconds = sorted(timings[1:])[1]
        ok = torch.equal(y.detach(), full[want]) and torch.equal(x.grad, full[mine])
        rows.append({"src": src, "dst": dst, "steps": [repr(st) for st in path.steps],
                     "predicted_s": path.cost_s, "measured_s": seconds, "ok": ok})
    return rows


def run_demo(world_size: int = 4) -> int:
    mesh = DeviceMesh((2, 2), axis_names=("dp", "tp"))
    print(f"automap demo: {world_size} gloo ranks on 127.0.0.1, mesh {mesh.shape} "
          f"(link model: alpha {mesh.alpha_s[0]:.0e} s, {mesh.bandwidth_bytes_per_s[0]:.0e} B/s "
          f"per axis; these are defaults, not measurements)")
    print(f"tensor {SHAPE} float32 through {' -> '.join(CHAIN)}")
    print("predicted: forward + backward under the link model; measured: median forward + "
          "backward on gloo (CPU processes, so not comparable)\n")
    results = run_on_gloo(_rank_main, world_size, mesh.to_dict(), timeout_s=120)
    all_ok = True
    for i, row in enumerate(results[0]):
        ok = all(r[i]["ok"] for r in results)
        all_ok &= ok
        measured = max(r[i]["measured_s"] for r in results)
        print(f"{row['src']:>5} -> {row['dst']:<5} predicted {1e6 * row['predicted_s']:8.1f} us"
              f"   measured on gloo {1e6 * measured:9.1f} us   "
              f"{'exact' if ok else 'MISMATCH'} on all ranks")
        for step in row["steps"]:
            print(f"        {step}")
    print("\nevery rank holds exactly its shard, and backward gives exactly the identity's "
          "gradient" if all_ok else "\nMISMATCH: a conversion gave a wrong shard or gradient")
    return 0 if all_ok else 1
