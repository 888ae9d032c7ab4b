"""Run inside spawned gloo processes by the model matrix (the test and
``benches/train_model_matrix.py``): plan a family's models on one mesh, train each
plan's module next to the serial model in float64 and report per model the
planning time, the node count, the replicated FLOP share and the largest
loss and gradient differences."""

from __future__ import annotations

import copy
import time
import traceback

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from automap import DeviceMesh
from automap.generate.program import generate
from automap.planner.plan import Plan
from automap.planner.search import plan as solve_plan
from automap.trace import hf_compat
from automap.trace.profiling import profile_traced
from automap.trace.tracing import default_loss, split_inputs, trace
from speeds import speeds

STEPS = 3
#: Functions of generate/ops.py whose use in a module's code the report lists.
REWRITES = ("class_parallel_cross_entropy", "class_parallel_logsumexp",
            "class_parallel_softmax", "class_parallel_log_softmax",
            "expert_parallel_grouped_mm", "vocab_parallel_embedding", "sharded_dropout",
            "sharded_random_like")
#: Slow enough that the ILP splits the compute of these tiny models (tensor,
#: sequence, expert and class splits besides the batch), which is what the
#: matrix exercises.
FLOPS_PER_S = 1e6


def _float64(inputs):
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, inputs)


#: Gradients that are mathematically zero (an attention key bias's) are float
#: noise on both sides: differences are taken relative to at least this share
#: of the largest gradient entry of the step.
GRAD_FLOOR = 1e-3


def max_grad_error(grads: dict, reference: dict) -> tuple[float, str]:
    """The largest difference over tensors, relative to the reference tensor's
    largest entry (at least GRAD_FLOOR of the step's largest), and its name."""
    scale = max((float(g.abs().max()) for g in reference.values() if g.numel()), default=0.0)
    worst = (0.0, "")
    for name, ref in reference.items():
        if not ref.numel():
            continue
        floor = max(GRAD_FLOOR * scale, 1e-300)
        diff = float((grads[name] - ref).abs().max()) / max(float(ref.abs().max()), floor)
        worst = max(worst, (diff, name))
    return worst


def _steps(module, inputs, loss_fn, grads_of, seed: int) -> tuple[list, list]:
    """STEPS AdamW steps, the generator seeded alike before each: losses and the
    gradients of every step (``loss_fn`` None: the module returns the loss)."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    args, kwargs = split_inputs(inputs)
    losses, grads = [], []
    for step in range(STEPS):
        torch.manual_seed(seed + step)
        out = module(*args, **kwargs)
        loss = out if loss_fn is None else loss_fn(out)
        loss.backward()
        grads.append(grads_of(module))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _serial(model, inputs, loss_fn, seed: int):
    serial = copy.deepcopy(model)
    if hf_compat.is_hf_model(serial):
        extra = hf_compat.call_kwargs(serial)
        call, serial_loss = serial, loss_fn

        class _Call(torch.nn.Module):  # the HF call arguments automap's trace adds
            def __init__(self):
                super().__init__()
                self.inner = call

            def forward(self, *a, **k):
                return self.inner(*a, **{**extra, **k})

        serial = _Call()
        loss_fn = serial_loss

    def grads_of(m):
        return {n.removeprefix("inner."): p.grad.detach().clone()
                for n, p in m.named_parameters() if p.grad is not None}

    return _steps(serial, inputs, loss_fn, grads_of, seed)


def replicated_flop_share(traced, plan: Plan) -> float:
    """Share of the step's FLOPs in nodes the plan runs replicated for want of a
    strategy (or by design: the bodies of higher-order ops)."""
    prof = profile_traced(traced, "adamw")
    total = sum(r.fwd_flops + r.bwd_flops for r in prof.nodes)
    replicated = sum(r.fwd_flops + r.bwd_flops for r in prof.nodes
                     if plan.nodes.get(r.name) is not None
                     and plan.nodes[r.name].kind == "replicate")
    return replicated / total if total else 0.0


def train_family(rank: int, world: int, names: list[str], mesh_shape, seed: int = 0
                 ) -> list[dict]:
    import model_matrix

    mesh = DeviceMesh(tuple(mesh_shape))
    groups = mesh.process_groups()
    results = []
    for name in names:
        out = {"model": name}
        payload = [None]
        try:
            model, inputs, loss_fn = model_matrix.build(name)
            model, inputs = model.double().train(), _float64(inputs)
            loss_fn = loss_fn or default_loss
            if rank == 0:
                start = time.perf_counter()
                # Every speed given: a measured one moves with the machine's load
                # and, in near ties, the plan with it.
                plan = solve_plan(model, inputs, mesh, loss_fn=loss_fn, **speeds(FLOPS_PER_S))
                out["plan_s"] = time.perf_counter() - start
                payload = [plan.to_dict()]
        except Exception as exc:  # reported per model; the family goes on
            _failed(out, exc)
        # Every rank reaches every collective of a model, failed or not: rank 0
        # failing to plan skipped this broadcast, the others took the next
        # model's plan for this one, and the ranks drifted a model apart until
        # the test's 800 s timeout (torch 2.13's Mixtral).
        dist.broadcast_object_list(payload, src=0)
        if payload[0] is None:
            out.setdefault("error", "rank 0 could not plan it")
        elif "error" not in out:
            try:
                plan = Plan.from_dict(payload[0])
                traced = trace(model, inputs, loss_fn=loss_fn)
                module = generate(traced, plan, model, groups)
            except Exception as exc:
                _failed(out, exc)
        if not _on_every_rank("error" not in out):
            out.setdefault("error", "another rank could not trace or generate it")
            results.append(out)
            continue
        try:
            losses, grads = _steps(module, inputs, None,
                                   lambda m: m.full_state_dict(gradients=True), seed)
            if rank == 0:
                serial_losses, serial_grads = _serial(model, inputs, loss_fn, seed)
                out.update(
                    nodes=len(plan.nodes), unsupported=dict(plan.unsupported_ops),
                    replicated_share=replicated_flop_share(traced, plan),
                    split_nodes=sum(1 for n in plan.nodes.values()
                                    if any(c != "R" for s in n.outputs for c in s)),
                    loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses)),
                    grad_rel=max(max_grad_error(g, s) for g, s in zip(grads, serial_grads)),
                    missing=sorted(set(serial_grads[0]) - set(grads[0])),
                    rewrites=[f for f in REWRITES if f + "(" in module.code],
                    replicated=sorted({n.op for n in plan.nodes.values()
                                       if n.kind == "replicate"}),
                    losses=losses, serial_losses=serial_losses)
        except Exception as exc:
            _failed(out, exc)
        results.append(out)
    return results


def _failed(out: dict, exc: Exception) -> None:
    out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    out["traceback"] = traceback.format_exc()[-4000:]


def _on_every_rank(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<17} ERROR {r['error'][:150]}"
    return (f"{r['model']:<17} {r['plan_s']:>6.1f} {r['nodes']:>6} {r['split_nodes']:>6} "
            f"{r['replicated_share']:>9.3f} {r['loss_rel']:>9.1e} {r['grad_rel'][0]:>9.1e}  "
            f"{','.join(f.split('_parallel_')[-1] for f in r['rewrites']) or '-'}")


HEADER = (f"{'model':<17} {'plan s':>6} {'nodes':>6} {'split':>6} {'repl FLOP':>9} "
          f"{'loss rel':>9} {'grad rel':>9}  rewrites")
