"""What a Plan records of the example inputs it was made for (their form,
shapes and dtypes), and same-shaped stand-ins rebuilt from that record, so
``automap.apply(plan, model)`` can trace the model again without the data.
The graph depends on shapes and dtypes, not on values."""

from __future__ import annotations

from typing import Any

import torch

from automap.errors import AutomapError
from automap.trace.tracing import split_inputs

_SCALARS = (bool, int, float, str, type(None))


def describe_inputs(example_inputs: Any) -> dict:
    """A JSON-able record of ``example_inputs`` (a tensor, a tuple/list of
    positional arguments, or a dict of keyword arguments)."""
    args, kwargs = split_inputs(example_inputs)
    form = ("dict" if isinstance(example_inputs, dict)
            else "sequence" if isinstance(example_inputs, (tuple, list)) else "tensor")
    return {"form": form, "args": [_describe(a) for a in args],
            "kwargs": {k: _describe(v) for k, v in kwargs.items()}}


def stand_in_inputs(description: dict | None, device: torch.device | str = "cpu") -> Any:
    """Inputs of the recorded form, shapes and dtypes, each tensor filled with its
    recorded fill: floating tensors zero, integer tensors one (a valid token id,
    class or mask value), bool True."""
    if not description:
        raise AutomapError("this plan does not record its example inputs (it was saved by an "
                           "older automap or built by hand); pass example_inputs to "
                           "automap.apply(plan, model, example_inputs)")
    args = [_stand_in(a, device) for a in description["args"]]
    kwargs = {k: _stand_in(v, device) for k, v in description["kwargs"].items()}
    if description["form"] == "dict":
        return kwargs
    if description["form"] == "tensor":
        return args[0]
    return tuple(args)


def _describe(value: Any) -> dict:
    if isinstance(value, torch.Tensor):
        fill = 0 if value.is_floating_point() or value.is_complex() else 1
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                "fill": fill}
    if isinstance(value, _SCALARS):
        return {"value": value}
    return {"unrecordable": type(value).__name__}


def _stand_in(record: dict, device) -> Any:
    if "value" in record:
        return record["value"]
    if "unrecordable" in record:
        raise AutomapError(f"the plan's example inputs held a {record['unrecordable']}, which "
                           "a plan cannot record; pass example_inputs to automap.apply")
    dtype = getattr(torch, record["dtype"])
    fill = record.get("fill", 0 if dtype.is_floating_point or dtype.is_complex else 1)
    return torch.full(record["shape"], fill, dtype=dtype, device=device)
