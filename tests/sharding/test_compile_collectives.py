"""The collectives' custom ops (what compiled code calls): their fake
implementations give the shapes, dtypes and strides the real ones produce
(run here on simulated groups, which allocate and send nothing), over one mesh
axis of 3 and over both axes of a (2, 2) mesh, and no result aliases its input."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from automap import DeviceMesh
from automap.sharding import collectives  # noqa: F401  (registers automap::*)
from automap.sharding.process_groups import SimulatedGroups

CASES = [  # op, positional arguments after the tensor
    ("all_gather_dim", (0,)), ("all_gather_dim", (1,)), ("split_dim", (0,)),
    ("split_dim", (1,)), ("all_to_all_dims", (0, 1)), ("all_to_all_dims", (1, 0)),
    ("all_reduce_sum", ()), ("identity_all_reduce_grad", ()), ("reduce_scatter_dim", (0,)),
    ("reduce_scatter_dim", (1,)),
]


@pytest.mark.parametrize("shape, axes", [((3,), (0,)), ((2, 2), (0, 1))])
@pytest.mark.parametrize("name, args", CASES)
def test_fake_shapes_are_the_real_ones(name, args, shape, axes):
    group = SimulatedGroups(DeviceMesh(shape), rank=1).axis_group(axes)
    op = getattr(torch.ops.automap, name)
    x = torch.randn(48, 12, dtype=torch.bfloat16)
    real = op(x, *args, group.compile_key)
    with FakeTensorMode() as mode:
        fake = op(mode.from_tensor(x), *args, group.compile_key)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    assert real.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
