"""The class-split cross-entropy keeps one tensor of the logits' local size for
its backward (the shard's softmax), as the serial op keeps its
log-probabilities and as the memory model counts: composed of autograd ops it
kept exp's output and the logits (the tests' GPT-2 with dropout on (2,2), the
class dim split: modelled 4.4 % under its simulated step before, 2.0 % after)."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from automap import DeviceMesh
from automap.generate import ops
from automap.sharding.process_groups import SimulatedGroups

pytestmark = pytest.mark.timeout(60)


def _group():
    # A simulated group sends nothing: the shard is the whole class range.
    return SimulatedGroups(DeviceMesh((2,)), 0, "gloo").axis_group((0,))


@pytest.mark.parametrize("ignored", [False, True])
def test_the_loss_and_its_gradient_are_the_serial_ones(ignored):
    torch.manual_seed(0)
    logits = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 8, (6,))
    if ignored:
        target[2] = -100
    loss = ops.class_parallel_cross_entropy(logits, target, -100, 0, _group())
    serial = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
    torch.testing.assert_close(loss, serial)
    weights = torch.randn(6, dtype=torch.float64)
    got = torch.autograd.grad((loss * weights).sum(), logits)[0]
    want = torch.autograd.grad((serial * weights).sum(), logits)[0]
    torch.testing.assert_close(got, want)


def test_the_loss_keeps_one_logits_sized_tensor():
    x = torch.randn(32, 16)
    weight = torch.randn(8, 16, requires_grad=True)
    logits = x @ weight.t()
    storage = weakref.ref(logits.untyped_storage())
    target = torch.randint(0, 8, (32,))
    loss = ops.class_parallel_cross_entropy(logits, target, -100, 0, _group())
    del logits
    gc.collect()
    assert storage() is None  # the logits are not kept
    fn = loss.grad_fn.next_functions[0][0]
    probs = fn.saved_tensors[0]
    assert probs.shape == (32, 8)
    assert sum(t.untyped_storage().nbytes() for t in fn.saved_tensors
               if t.is_floating_point()) == 32 * 8 * 4
