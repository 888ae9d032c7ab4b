"""The adjustments Hugging Face ``transformers`` models need to be traced for training.

automap applies them itself when it traces a ``transformers.PreTrainedModel``; they are
also usable directly when running the same model eagerly so that what runs matches what
was planned. Nothing here changes the user's model for good: the attention
implementation is switched only inside :func:`adjusted` and restored on exit, and the
other adjustments are call arguments, not configuration edits.

The adjustments:

- ``use_cache=False``: a KV cache is an inference structure; in training it only costs
  memory, and its ``Cache`` object is not an exportable output.
- ``return_dict=True``: a ``ModelOutput`` is a registered pytree, so the exported graph
  keeps its field names and the loss is found by name.
- the loss: when the example inputs carry ``labels`` the model computes its own loss,
  which :func:`loss_from_output` returns.
- the attention implementation: ``"sdpa"`` (one fused aten op, the default in recent
  transformers) or ``"eager"`` (matmul + softmax, which saves the attention
  probabilities for backward). Only switched when asked for.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from torch import nn


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (without importing
    transformers when the user does not use it)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(model).__mro__
    )


def call_kwargs(model: nn.Module) -> dict[str, Any]:
    """The keyword arguments a training call of ``model`` should add: ``use_cache=False``
    and ``return_dict=True`` where its ``forward`` accepts them."""
    params = inspect.signature(model.forward).parameters
    takes_var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    wanted = {"use_cache": False, "return_dict": True}
    return {k: v for k, v in wanted.items() if k in params or takes_var_kwargs}


@contextlib.contextmanager
def adjusted(model: nn.Module, attn_implementation: str | None = None) -> Iterator[nn.Module]:
    """Switch ``model`` to ``attn_implementation`` for the duration of the block and
    restore the previous implementation afterwards. ``None`` leaves it as configured."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if attn_implementation is None or attn_implementation == previous:
        yield model
        return
    model.set_attn_implementation(attn_implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def loss_from_output(output: Any) -> Any:
    """The loss of a ``ModelOutput`` (``None`` when the model computed none, i.e. when the
    inputs had no ``labels``)."""
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)
