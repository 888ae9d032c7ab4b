"""The random ops of a generated program draw the serial model's numbers whole
and keep this shard's block in a storage of its own: a view of the whole
tensor saved for the backward would keep all of it alive (GPT-2 small on
(2,2,2) held 24 MiB of whole dropout masks per dropout where the memory model
planned 3 MiB blocks)."""

import pytest
import torch

from automap.generate import ops

pytestmark = pytest.mark.timeout(60)

GLOBAL = [8, 6]


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("bounds", [((0, 4), (0, 6)), ((0, 8), (3, 6)), ((4, 8), (0, 3))])
def test_a_sharded_dropout_saves_only_its_block(bounds):
    torch.manual_seed(0)
    whole_x = torch.randn(GLOBAL, requires_grad=True)
    serial = torch.ops.aten.dropout.default(whole_x, 0.5, True)
    torch.manual_seed(0)
    torch.randn(GLOBAL)  # the same draws as the serial model's input
    block = tuple(slice(a, b) for a, b in bounds)
    x = whole_x.detach()[block].clone().requires_grad_()
    out = ops.sharded_dropout(torch.ops.aten.dropout.default, x, 0.5, True, GLOBAL, bounds)
    torch.testing.assert_close(out, serial[block])
    saved = out.grad_fn._saved_other
    assert _storage_bytes(saved) == x.numel() * x.element_size()
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(serial.sum(), whole_x)[0][block])


def test_the_whole_tensor_is_kept_as_it_is_when_the_block_is_all_of_it():
    x = torch.randn(GLOBAL, requires_grad=True)
    out = ops.sharded_dropout(torch.ops.aten.dropout.default, x, 0.5, True, GLOBAL,
                              ((0, 8), (0, 6)))
    assert _storage_bytes(out.grad_fn._saved_other) == x.numel() * x.element_size()


def test_a_sharded_random_tensor_owns_only_its_block():
    torch.manual_seed(1)
    serial = torch.rand(GLOBAL)
    torch.manual_seed(1)
    x = torch.empty(4, 6)
    out = ops.sharded_random_like(torch.rand_like, x, GLOBAL, ((4, 8), (0, 6)))
    torch.testing.assert_close(out, serial[4:])
    assert _storage_bytes(out) == out.numel() * out.element_size()
