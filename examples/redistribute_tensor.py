"""Convert a sharded tensor between two layouts on a 2x2 device mesh.

    torchrun --nproc-per-node 4 examples/redistribute_tensor.py

Each rank holds its shard of a 512x256 tensor laid out as S0R (rows split over
mesh axis 0, replicated over axis 1) and converts it to RS01 (columns split
over both axes) along the cheapest path the layout manager finds.
"""

import torch
import torch.distributed as dist

import automap
from automap.sharding.redistribute import redistribute


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    mesh = automap.DeviceMesh((2, 2), axis_names=("dp", "tp"))
    groups = mesh.process_groups()
    shape = [512, 256]
    src, dst = automap.ShardingSpec.parse("S0R"), automap.ShardingSpec.parse("RS01")

    path = automap.layout_path(mesh, src, dst, shape)  # searched once, then cached
    full = torch.arange(512 * 256, dtype=torch.float32).reshape(shape)
    mine = tuple(slice(a, b) for a, b in src.local_slices(shape, mesh, dist.get_rank()))
    out = redistribute(full[mine].clone(), path, groups)

    want = tuple(slice(a, b) for a, b in dst.local_slices(shape, mesh, dist.get_rank()))
    assert torch.equal(out, full[want])
    if dist.get_rank() == 0:
        print(path)
        for step in path.steps:
            print("  ", step)
        print(f"rank 0 went from a {tuple(full[mine].shape)} shard to {tuple(out.shape)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
