"""The DTensor placements a plan gives each parameter and buffer, by the user's
names (``Plan.placements``): those of the generated module's ``state_dict()``.

A plan names state by its placeholder (``p_model_h_0_attn_weight``: torch.export's
name, the user's name lowercased with every other character ``_``) and its module
path (exact). With the model, names are matched exactly and tied names (GPT-2's
``lm_head.weight``) get the placements of the tensor they share, as the generated
module stores it; without it, the name is the module path plus the placeholder's
last part, exact for lowercase parameter names (torch's and Hugging Face's)."""

from __future__ import annotations

import re

from automap.sharding.spec import to_dtensor_placements

#: torch.export's placeholder prefixes of state, and the wrapper module automap
#: traces the model under (``trace.tracing``).
_PREFIXES = {"parameter": "p_", "buffer": "b_"}
_INNER = "model."


def _export_name(kind: str, name: str) -> str:
    return _PREFIXES[kind] + re.sub(r"[^a-zA-Z0-9]", "_", (_INNER + name).lower())


def state_placements(plan, model=None) -> dict[str, tuple]:
    """Every parameter and buffer the plan places, by the user's name: a tuple of
    DTensor placements, one per mesh axis (``Shard``, ``_StridedShard`` for axes
    out of order, ``Replicate``). Needs no process group."""
    specs = {node.name: node for node in plan.nodes.values()
             if node.op == "placeholder" and node.kind in _PREFIXES}
    by_name = _names_from_model(specs, model) if model is not None else {
        _name_from_placeholder(node): (node.name, node.name) for node in specs.values()}
    return {name: tuple(to_dtensor_placements(specs[owner].outputs[0], plan.mesh))
            for name, (_, owner) in by_name.items()}


def _name_from_placeholder(node) -> str:
    stem = _export_name(node.kind, node.module_path + "." if node.module_path else "")
    stem = stem.rstrip("_") + "_"
    return (f"{node.module_path}." if node.module_path else "") + node.name[len(stem):] \
        if node.name.startswith(stem) else node.name


def _names_from_model(specs: dict, model) -> dict[str, tuple[str, str]]:
    """user name -> (its placeholder, the placeholder whose spec stores it: the
    first name of its tie group)."""
    out: dict[str, tuple[str, str]] = {}
    first_of: dict[int, str] = {}
    taken: dict[str, int] = {}
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            base = _export_name(kind, name)
            # torch.export numbers colliding names in order: base, base_1, ...
            count = taken.get(base, 0)
            taken[base] = count + 1
            placeholder = base if count == 0 else f"{base}_{count}"
            if placeholder not in specs:
                continue
            owner = first_of.setdefault(id(tensor), placeholder)
            out[name] = (placeholder, owner)
    return out
