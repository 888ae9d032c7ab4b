"""Gloo workers of ``test_numerics.py``: small models under forced plans that
split what issue 16 is about (class and expert dims, complex and empty
tensors, custom Functions, random ops), trained next to the serial model in
float64."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from automap import AutomapError, DeviceMesh
from automap.generate.program import generate
from automap.planner.plan import Plan
from automap.trace.tracing import default_loss, trace
from forced_plans import BATCH, forced_plan
from matrix_workers import REWRITES, _float64, _serial, _steps, max_grad_error


class LogSumExpLoss(nn.Module):
    """A classifier whose loss is written with logsumexp and log_softmax."""

    def __init__(self, classes: int = 64) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(16, 32), nn.Linear(32, classes)

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.fc(x)))
        picked = logits.gather(1, y[:, None])[:, 0]
        nll = F.nll_loss(F.log_softmax(logits, -1), y)
        return (torch.logsumexp(logits, -1) - picked).mean() + nll


class WeightedCrossEntropy(nn.Module):
    """Cross-entropy with class weights and an ignored class: over a split
    batch its mean divides by the global weight sum of the kept targets."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(16, classes)
        self.register_buffer("class_weight", torch.rand(classes) + 0.1)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y, weight=self.class_weight, ignore_index=3)


class Noisy(nn.Module):
    """Reads its dropout masks and noise through its weight's gradient: the loss
    is sum(w * dropout(x)) + sum(w * rand_like(x)), so w.grad = mask + noise."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8, 16))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return (self.w * self.drop(x)).sum() + (self.w * torch.rand_like(x)).sum()


class AttentionDropout(nn.Module):
    """Attention with its own dropout on a batch of identical rows; its output
    (read through u's gradient) shows whether two rows drew the same mask."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 16))
        self.u = nn.Parameter(torch.ones(8, 4, 16))

    def forward(self, x):
        h = x * self.w
        out = F.scaled_dot_product_attention(h, h, h, dropout_p=0.5)
        return (out * self.u).sum()


class ShiftRight(nn.Module):
    """Hugging Face's shift_tokens_right: an in-place write into a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1]
        return self.emb(shifted).sum()


def _models():
    import model_matrix

    def logsumexp():
        return LogSumExpLoss(), (torch.randn(8, 16), torch.randint(0, 64, (8,))), None

    def noisy():
        return Noisy(), (torch.ones(8, 16),), None

    def weighted_ce():
        return WeightedCrossEntropy(), (torch.randn(8, 16), torch.randint(0, 10, (8,))), None

    def attention_dropout():
        return AttentionDropout(), (torch.randn(1, 4, 16).expand(8, 4, 16).clone(),), None

    def shift_right():
        return ShiftRight(), (torch.randint(0, 16, (8, 6)),), None

    local = {"shift_right": shift_right, "logsumexp": logsumexp, "noisy": noisy,
             "weighted_ce": weighted_ce,
             "attention_dropout": attention_dropout}
    return {**local, **{name: builder for models in model_matrix.MATRIX.values()
                        for name, builder in models.items()}}


def _batch_only(ins, outs) -> bool:
    return all(re.fullmatch(r"(S[0-9]+)?R*", s) for s in (*ins, *outs))


def _class_split(ins, outs) -> bool:
    return bool(re.fullmatch(r"RS0", ins[0]))


#: Forced plans, by name: forced_plan's keyword arguments for a mesh.
FORCED = {
    # The batch split over every axis, every parameter replicated.
    "batch": lambda mesh, inputs: {"params": {}, "inputs": {n: BATCH for n in inputs}},
    # The logits' class dim split (vocab-parallel loss).
    "classes": lambda mesh, inputs: {
        "inputs": {n: "R" * len(s) for n, s in inputs.items()},
        "ops": {"cross_entropy_loss": _class_split, "logsumexp": _class_split,
                "_log_softmax": _class_split, "log_softmax": _class_split}},
    # Mixtral's experts split (expert parallelism).
    "experts": lambda mesh, inputs: {
        "params": {r"experts\.(gate_up_proj|down_proj)": "S0RR"},
        "ops": {f"grouped_mm_fallback{s}": lambda ins, outs: ins[1].startswith("S0")
                for s in ("", "_1", "_2", "_3")}},
    # The written slice reads its base converted (split -> whole): a lost write.
    "converted_base": lambda mesh, inputs: {
        "ops": {"new_zeros": lambda ins, outs: outs[0] == "S0R",
                "slice_2": lambda ins, outs: ins[0] == "RR"}},
    # Every parameter and op replicated: random ops run whole on every rank.
    "replicated": lambda mesh, inputs: {"params": {}, "inputs": {n: "R" * len(s)
                                                                for n, s in inputs.items()}},
}


def train_forced(rank: int, world: int, cases: list[dict], seed: int = 0) -> list[dict]:
    """For each case (model, mesh shape, forced plan): 3 AdamW steps of the
    plan's module and of the serial model, the largest differences, which of
    ops.py's rewrites the module runs, and every step's full gradients."""
    models = _models()
    results, groups = [], {}
    for case in cases:
        mesh = DeviceMesh(tuple(case["mesh"]))
        if mesh.shape not in groups:
            groups[mesh.shape] = mesh.process_groups()
        torch.manual_seed(seed)
        model, inputs, loss_fn = models[case["model"]]()
        model, inputs = model.double().train(), _float64(inputs)
        loss_fn = loss_fn or default_loss
        traced = trace(model, inputs, loss_fn=loss_fn)
        shapes = {n.name: tuple(n.meta["val"].shape) for n in traced.graph.nodes
                  if n.name in traced.user_input_nodes}
        payload = [None]
        if rank == 0:
            kwargs = FORCED[case["plan"]](mesh, shapes)
            try:  # planning runs the generator too (to simulate the plan's memory)
                payload = [forced_plan(model, inputs, loss_fn, mesh, **kwargs)[1].to_dict()]
            except AutomapError as err:
                payload = [{"error": str(err)}]
        torch.distributed.broadcast_object_list(payload, src=0)
        try:
            if "error" in payload[0]:
                raise AutomapError(payload[0]["error"])
            plan = Plan.from_dict(payload[0])
            module = generate(traced, plan, model, groups[mesh.shape])
        except AutomapError as err:
            results.append({"case": case, "error": str(err)})
            continue
        losses, grads = _steps(module, inputs, None,
                               lambda m: m.full_state_dict(gradients=True), seed)
        out = {"case": case, "grads": grads,
               "rewrites": [f for f in REWRITES if f + "(" in module.code],
               "kinds": {n: p.kind for n, p in plan.nodes.items()},
               "outputs": {n: p.outputs for n, p in plan.nodes.items()}}
        if rank == 0:
            serial_losses, serial_grads = _serial(model, inputs, loss_fn, seed)
            out.update(serial_grads=serial_grads, losses=losses, serial_losses=serial_losses,
                       loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses)),
                       grad_rel=max(max_grad_error(g, s)
                                    for g, s in zip(grads, serial_grads)))
        results.append(out)
    return results
