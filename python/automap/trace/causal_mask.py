"""Attention masks that are the causal pattern, built from constants while tracing.

Hugging Face models call ``scaled_dot_product_attention(..., is_causal=True)`` without a
mask when they run eagerly, but under ``torch.export`` they build the causal mask from
``arange`` and comparisons and pass it as ``attn_mask``: the traced program then
materialises a (batch, 1, L, S) mask and runs the masked kernel, which computes every
block of the score matrix where the causal kernel skips those above the diagonal (13 %
slower on this CPU for GPT-2-tiny's attention, forward and backward). This module finds
the masks whose value is exactly the causal pattern whatever the inputs and marks their
attention nodes (``CAUSAL_MASK`` in ``node.meta``); the program generator then calls
the causal kernel without the mask wherever the plan keeps the queries' sequence dim
whole (a query block of a split sequence needs its rows of the mask).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

log = logging.getLogger(__name__)

#: ``node.meta`` key of an attention node whose ``attn_mask`` is the causal pattern.
CAUSAL_MASK = "automap_causal_mask"

#: Masks are evaluated on the CPU to be compared; larger intermediates are not worth
#: the transient memory (the masked kernel then runs as traced).
MAX_EVALUATED_ELEMENTS = 2**25


def causal_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of a marked attention call as the causal kernel without the
    mask: what the generated program runs where the queries' sequence is whole
    (``generate.localize.causal_attention``), and what the profile records."""
    kwargs = dict(kwargs)
    dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    for key in ("attn_mask", "dropout_p", "is_causal"):
        kwargs.pop(key, None)
    return (*args[:3], None, dropout_p, True), kwargs


def mark_causal_masks(gm: fx.GraphModule) -> int:
    """Mark every attention node of ``gm`` whose mask is the causal pattern; the count."""
    marked = 0
    cache: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or _family(node) != "scaled_dot_product_attention":
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        if not isinstance(mask, fx.Node) or is_causal:
            continue
        if mask not in cache:
            cache[mask] = _is_causal_pattern(mask, _query_key_lengths(node))
        if cache[mask]:
            node.meta[CAUSAL_MASK] = True
            marked += 1
    if marked:
        log.info("%d attention ops have a constant causal mask", marked)
    return marked


def _family(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _query_key_lengths(node: fx.Node) -> tuple[int, int]:
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    return int(q.shape[-2]), int(k.shape[-2])


def _is_causal_pattern(mask: fx.Node, lengths: tuple[int, int]) -> bool:
    """Whether ``mask`` depends on nothing but constants and equals, in every
    broadcast slice, torch's causal pattern (``ones(L, S).tril()``: True or 0 where a
    query attends, False or at most the dtype's lowest value where it does not)."""
    subgraph = _constant_ancestors(mask)
    if subgraph is None:
        return False
    try:
        value = _evaluate(subgraph, mask)
    except Exception as exc:  # an op we cannot rerun on the CPU: keep the mask
        log.debug("mask %s not evaluated: %s", mask.name, exc)
        return False
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    if tuple(value.shape[-2:]) != lengths:
        return False
    allowed = torch.ones(lengths, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == allowed).all())
    if not value.is_floating_point():
        return False
    blocked_ok = value <= torch.finfo(value.dtype).min
    return bool(torch.where(allowed, value == 0, blocked_ok).all())


def _constant_ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order, or None when any of them
    reads an input, a parameter, a buffer or random numbers, or is too large."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return None
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            return None
        if node.target._schema.is_mutable:
            return None
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() > MAX_EVALUATED_ELEMENTS:
            return None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(subgraph: list[fx.Node], mask: fx.Node) -> torch.Tensor:
    """Run the constant nodes on the CPU; the mask's value."""
    values: dict[fx.Node, torch.Tensor] = {}

    def load(a):
        if isinstance(a, fx.Node):
            return values[a]
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    for node in subgraph:
        args = fx.node.map_aggregate(node.args, load)
        kwargs = {k: load(v) if k != "device" else torch.device("cpu")
                  for k, v in node.kwargs.items()}
        values[node] = node.target(*args, **kwargs)
    return values[mask]
