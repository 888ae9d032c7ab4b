"""The CPU convolution's kernel scratch (``trace/kernel_scratch.py``): a step that
runs convolutions is profiled at the peak the allocator reaches (PyTorch
profiler memory events), including thin inputs as channel shards make them,
where a layout rule derived from oneDNN's allocations over-estimated."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import model_zoo
from automap.trace import kernel_scratch
from automap.trace.profiling import profile


class TwoConvs(nn.Module):
    """A 1x1 convolution makes the second one's input require a gradient, so
    its backward computes every output (input, weight and bias gradients)."""

    def __init__(self, channels: int, out: int, kernel: int, stride: int, groups: int) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, channels, 1)
        self.second = nn.Conv2d(channels, out, kernel, stride, kernel // 2, groups=groups)

    def forward(self, x):
        return self.second(self.first(x))


def _sum(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


# (input channels, output channels, kernel, stride, groups): the thin inputs of
# channel shards (4 of 16), 1x1 and 7x7 kernels, a strided and a grouped one.
SHAPES = [(4, 16, 3, 1, 1), (16, 16, 3, 1, 1), (2, 8, 1, 1, 1), (4, 8, 7, 2, 1),
          (8, 8, 3, 1, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_convolution_steps_profile_at_the_measured_peak(shape):
    torch.manual_seed(0)
    model = TwoConvs(*shape)
    x = torch.randn(16, 3, 16, 16)
    estimate = profile(model, (x,), None, loss_fn=_sum)
    measured = model_zoo.measure_step(model, (x,), _sum, None)
    assert estimate.peak_memory_bytes == measured.peak_bytes


def test_scratch_is_measured_once_per_signature(monkeypatch):
    op = torch.ops.aten.convolution.default
    runs = []
    monkeypatch.setattr(kernel_scratch, "_measured", {})
    monkeypatch.setattr(kernel_scratch, "_run", lambda func, args: runs.append(args) or 5)
    for batch in (2, 2, 3):
        args = (torch.empty(batch, 4, 8, 8), torch.empty(8, 4, 3, 3), None, [1, 1], [1, 1],
                [1, 1], False, [0, 0], 1)
        assert kernel_scratch.measured_scratch(op, args, None, lambda a, o: -1) == 5
    assert [a[0].shape[0] for a in runs] == [2, 3]


def test_unmeasured_ops_use_the_estimate(monkeypatch):
    op = torch.ops.aten.convolution.default
    args = (torch.empty(2, 3, 8, 8), torch.empty(4, 3, 3, 3), None, [1, 1], [1, 1], [1, 1],
            False, [0, 0], 1)
    monkeypatch.setattr(kernel_scratch, "MEASURE_LIMIT_BYTES", 0)
    assert kernel_scratch.measured_scratch(op, args, None, lambda a, o: 7) == 7
    monkeypatch.undo()
    with torch.autograd.profiler.profile(profile_memory=True):  # profilers do not nest
        assert kernel_scratch.measured_scratch(op, args, None, lambda a, o: 7) == 7


def test_a_measuring_limit_estimates_larger_ops(monkeypatch):
    """The strategy table asks local shapes within ``measuring_within``: larger
    ops are estimated, not run (planning time on 3-D meshes)."""
    op = torch.ops.aten.convolution.default
    args = (torch.empty(2, 3, 8, 8), torch.empty(4, 3, 3, 3), None, [1, 1], [1, 1], [1, 1],
            False, [0, 0], 1)
    monkeypatch.setattr(kernel_scratch, "_measured", {})
    monkeypatch.setattr(kernel_scratch, "_run", lambda func, args: 5)
    with kernel_scratch.measuring_within(100):
        assert kernel_scratch.measured_scratch(op, args, None, lambda a, o: 7) == 7
    assert kernel_scratch.measured_scratch(op, args, None, lambda a, o: 7) == 5


def test_measuring_writes_nothing_to_stderr(capfd):
    """torch's profiler library logs each start and stop on the process's
    stderr from C++ (torch 2.15: "USDT: ... profiler_start"); a plan measures
    every convolution signature it meets, two such lines each."""
    kernel_scratch._measured.clear()
    profile(TwoConvs(4, 8, 3, 1, 1), (torch.randn(2, 3, 8, 8),), loss_fn=_sum)
    assert kernel_scratch._measured, "nothing was measured: the test needs a measured op"
    assert capfd.readouterr().err == ""
