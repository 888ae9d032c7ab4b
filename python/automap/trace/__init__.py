"""Tracing and profiling: a model and its example inputs become an aten-level
graph ending in the loss (``tracing``, with Hugging Face fixes in ``hf_compat``),
profiled symbolically for FLOPs and memory per node (``profiling``); the inputs'
shapes are recorded for re-tracing (``example_inputs``). Hands a
``TracedGraph`` and a ``Profile`` to ``solve``, ``checkpoint`` and ``generate``."""
