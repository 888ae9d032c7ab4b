"""State an op writes in place (a training batch norm's running statistics,
whose schema does not mark them) must reach the op as stored: a conversion
would make the op update a copy and lose the update. The planner never
chooses such a plan when another exists, and the generator refuses one
(a ResNet plan once lost ``running_mean`` this way on (4,))."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automap import AutomapError, DeviceMesh
from automap.planner.search import plan
from forced_plans import forced_plan, output_is
from speeds import speeds

MESH = DeviceMesh((4,))


def _conv_bn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(4, 3, 8, 8)
    return model, (x,), lambda out: out.pow(2).mean()


def test_the_planner_keeps_running_statistics_as_stored():
    model, inputs, loss_fn = _conv_bn()
    for flops in (1e6, 1e9, 1e12):
        p = plan(model, inputs, MESH, loss_fn=loss_fn, **speeds(flops))
        stats = [e for e in p.edges
                 if p.nodes[e.consumer].op == "batch_norm" and e.input_index in (3, 4)]
        assert len(stats) == 2
        assert all(e.src == e.dst for e in stats), (flops, stats)


def test_the_generator_refuses_a_converted_running_statistic():
    model, inputs, loss_fn = _conv_bn()
    # Force the running mean stored split and the batch norm to read it whole:
    # the generator refuses the plan (planning simulates it, so planning fails).
    with pytest.raises(AutomapError, match="write would be lost"):
        forced_plan(model, inputs, loss_fn, MESH, params={},
                    ops={"b_model_1_running_mean": output_is("S0"),
                         "batch_norm": lambda ins, outs: ins[0] == "RRRR"})


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_buffer_written_under_no_grad_is_updated_once_in_a_checkpointed_region(tmp_path):
    """``torch.no_grad()`` around an in-place buffer update exports as a wrapped
    subgraph; its write was not seen, so a checkpoint region recomputing it
    wrote the buffer twice and planning failed in autograd's version check."""
    import copy

    from automap import InfeasibleBudgetError
    from automap.launch import run_on_gloo
    from written_state_workers import build, train, train_planned

    model, inputs = build()
    mesh, slow = DeviceMesh((2,)), speeds(1e6)
    with pytest.raises(InfeasibleBudgetError) as refused:
        plan(model, inputs, mesh, 1.0, loss_fn=lambda loss: loss, checkpointing="only", **slow)
    least = refused.value.smallest_feasible_budget_bytes
    checkpointed = plan(model, inputs, mesh, least, loss_fn=lambda loss: loss,
                        checkpointing="only", **slow)
    assert checkpointed.checkpoint is not None and checkpointed.checkpoint.block_count() >= 1
    path = tmp_path / "ema.json"
    checkpointed.to_json(path)
    serial = copy.deepcopy(model)
    serial_losses = train(serial, inputs)
    results = run_on_gloo(train_planned, 2, str(path), timeout_s=200)
    losses, state = results[0]
    assert max(abs(a - b) for a, b in zip(losses, serial_losses)) <= 1e-12
    for name, value in serial.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-14)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_no_grad_update_that_returns_nothing_gets_its_operands_whole(tmp_path):
    """A ``torch.no_grad()`` update of a buffer that nothing reads afterwards
    exports as a wrapped subgraph without outputs: it was left out of the
    strategy table, its operands took any layout, and a batch-split mean was
    added into the whole buffer (planning failed in the simulated step). Every
    plan, from replicated to sharded, now trains and updates the buffers like
    the serial model."""
    import copy

    from automap.launch import run_on_gloo
    from written_state_workers import build, train, train_planned

    model, inputs = build(read_back=False)
    serial = copy.deepcopy(model)
    serial_losses = train(serial, inputs)
    for flops in (1e6, 1e12):
        p = plan(model, inputs, DeviceMesh((2,)), loss_fn=lambda loss: loss, **speeds(flops))
        path = tmp_path / f"ema_{flops:g}.json"
        p.to_json(path)
        for losses, state in run_on_gloo(train_planned, 2, str(path), False, timeout_s=200):
            assert max(abs(a - b) for a, b in zip(losses, serial_losses)) <= 1e-12
            for name, value in serial.state_dict().items():
                torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-14)


class _Lerp(nn.Module):
    """A buffer written in place (``lerp_``) from a batch statistic."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)
        self.register_buffer("ema", torch.zeros(10))

    def forward(self, x):
        h = self.fc(x)
        self.ema.lerp_(h.mean(0).detach(), 0.1)
        return (h - self.ema).pow(2).mean()


@pytest.mark.parametrize("checkpointing", ["off", "auto"])
def test_a_budget_never_buys_a_conversion_into_a_written_input(checkpointing):
    """The write must reach the stored buffer: a conversion into it was only
    priced (1,000 s), and a tight budget bought one, so planning failed in the
    generator with a bare AutomapError. Every budget now plans or names a least
    budget at which it plans."""
    from automap import InfeasibleBudgetError

    torch.manual_seed(0)
    model, x = _Lerp().double(), torch.randn(8, 10, dtype=torch.float64)
    mesh, slow = DeviceMesh((2,)), speeds(1e8)
    peak = plan(model, (x,), mesh, loss_fn=lambda loss: loss, **slow).predicted_peak_memory_bytes
    least = None
    for fraction in (0.4, 0.6, 0.8, 1.0):
        try:
            plan(model, (x,), mesh, fraction * peak, loss_fn=lambda loss: loss,
                 checkpointing=checkpointing, **slow)
        except InfeasibleBudgetError as err:
            least = err.smallest_feasible_budget_bytes
    assert least is not None
    plan(model, (x,), mesh, least, loss_fn=lambda loss: loss, checkpointing=checkpointing, **slow)
