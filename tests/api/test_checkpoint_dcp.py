"""Issue 19, point 1: sharded checkpoints with torch.distributed.checkpoint.

On 4 gloo ranks a tiny GPT-2 trains 2 AdamW steps under a (2,2) plan of a tight
budget (MLP weights split over both axes, axis 1 outermost: ``_StridedShard``
placements), is saved with ``dcp.save`` from its DTensor state dict (every rank
writes its own blocks: no gather), then loaded into fresh modules of (a) a (4,)
plan, (b) the same mesh's unconstrained plan and the saving plan itself, and
(c) the serial model in a process with no process group (``dcp_to_torch_save``):
weights equal the saved ones exactly, AdamW's state comes along, and 2 more steps
give the losses of the uninterrupted run (and of the serial model). A second run
saves an MLP from a (2,2) mesh of permuted ranks and loads it under (4,)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from automap.launch import run_on_gloo
from checkpoint_dcp_workers import AFTER, BEFORE, permuted_mesh, save_and_reload
from serial import build, make_optimizer

#: Relative tolerance of losses across plans (fp32; the reductions' order differs).
LOSS_TOL = 1e-5
#: Absolute tolerance of parameters after the steps that follow the load.
PARAM_TOL = 1e-5


def _serial_losses(model, inputs, loss_fn, opt, steps: int) -> list[float]:
    """``steps`` AdamW steps of the serial model, called as the tests' serial runs are."""
    from automap.trace import hf_compat
    from automap.trace.tracing import default_loss, split_inputs

    args, kwargs = split_inputs(inputs)
    kwargs = {**hf_compat.call_kwargs(model), **kwargs}
    losses = []
    for _ in range(steps):
        loss = (loss_fn or default_loss)(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= LOSS_TOL * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_save_on_2x2_load_anywhere(tmp_path):
    directory = str(tmp_path / "checkpoint")
    results = run_on_gloo(save_and_reload, 4, directory, timeout_s=540)
    first = results[0]
    print("specs per plan:", first["specs"])
    assert any("10" in s for s in first["specs"]["save_2x2_tight"])  # S10R / RS10: strided
    assert first["specs"]["save_2x2_tight"] != first["specs"]["load_2x2_loose"]

    # The uninterrupted serial run: BEFORE + AFTER AdamW steps.
    model, inputs, loss_fn = build("gpt2")
    serial = copy.deepcopy(model)
    serial_opt = make_optimizer("adamw", serial.parameters())
    serial_losses = _serial_losses(serial, inputs, loss_fn, serial_opt, BEFORE + AFTER)
    for r in results:
        assert _close(r["losses_before"], serial_losses[:BEFORE]), r["losses_before"]
        assert _close(r["losses_uninterrupted"], serial_losses[BEFORE:])
    assert first["state_dict_types"] == ["DTensor"]
    assert any("_S(0, 2)" in p for ps in first["placements"].values() for p in ps), \
        first["placements"]
    assert first["placements"] == first["plan_placements"]  # Plan.placements(model)

    # Saved sharded: a weight split over both axes is 4 chunks, one per rank.
    metadata = FileSystemReader(directory).read_metadata()
    fc = metadata.state_dict_metadata["model.transformer.h.0.mlp.c_proj.weight"]
    assert len(fc.chunks) == 4 and fc.size == torch.Size([256, 64])
    exp_avg = metadata.state_dict_metadata["optim.state.transformer.h.0.mlp.c_proj.weight.exp_avg"]
    assert len(exp_avg.chunks) == 4

    for name, record in first["loaded"].items():
        print(f"{name}: weights vs saved {record['max_weight_diff']:.1e}, losses "
              f"{record['losses_after']} (uninterrupted {first['losses_uninterrupted']}), "
              f"final params vs uninterrupted {record['max_final_diff']:.1e}")
        assert record["max_weight_diff"] == 0.0, name
        assert record["placements_match_plan"], name
        assert record["steps"] == [float(BEFORE)], name  # AdamW's step count came along
        for r in results:
            assert _close(r["loaded"][name]["losses_after"], first["losses_uninterrupted"]), name
        assert record["max_final_diff"] <= PARAM_TOL, name

    print(f"from another plan's DTensors {first['from_other_placements']:.1e}, from whole "
          f"tensors {first['from_whole']:.1e}")
    assert first["from_other_placements"] == 0.0 and first["from_whole"] == 0.0
    assert "not a rank's shard" in first["shard_refused"], first.get("shard_refused")

    # (c) The serial model, in this process (no process group): the checkpoint as
    # one torch.save file of whole tensors.
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(directory, str(whole))
    state = torch.load(whole, weights_only=False)
    restored = copy.deepcopy(model)
    restored.load_state_dict(state["model"])  # strict: every key, tied names included
    restored_opt = make_optimizer("adamw", restored.parameters())
    set_optimizer_state_dict(restored, restored_opt, state["optim"])
    losses = _serial_losses(restored, inputs, loss_fn, restored_opt, AFTER)
    print(f"serial from checkpoint: {losses}, uninterrupted serial {serial_losses[BEFORE:]}")
    assert _close(losses, serial_losses[BEFORE:])
    final = first["full_uninterrupted"]
    worst = max(float((p.detach() - final[n]).abs().max())
                for n, p in restored.named_parameters())
    assert worst <= PARAM_TOL, worst


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_mesh_of_permuted_ranks(tmp_path):
    """A (2,2) mesh over ranks [3, 1, 0, 2], weights split over both axes in both
    orders (``S10R``, ``RS01``, ``S1S0``): the torch mesh keeps automap's
    coordinates, so the checkpoint loads under a (4,) plan and training goes on
    with the uninterrupted run's losses."""
    results = run_on_gloo(permuted_mesh, 4, str(tmp_path / "checkpoint"), timeout_s=360)
    first = results[0]
    assert {"S10R", "RS01", "S1S0"} <= set(first["specs"].values()), first["specs"]
    print(f"weights vs saved {first['max_weight_diff']:.1e}, losses {first['losses_after']} "
          f"(uninterrupted {first['losses_uninterrupted']})")
    for r in results:
        assert r["max_weight_diff"] == 0.0
        assert _close(r["losses_after"], r["losses_uninterrupted"])
