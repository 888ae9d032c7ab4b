"""Random strategy-table nodes for the ILP's property tests: a parameter or an
einsum with ``len(out_specs)`` strategies whose times and bytes are drawn
from ``rng`` (the scales keep budgets of a few hundred bytes interesting)."""

from __future__ import annotations

import random

import numpy as np

from automap.solve.strategies import NodeOptions, TensorInfo


def random_node(rng: random.Random, name: str, parameter: bool, inputs, shape,
                in_specs, out_specs) -> NodeOptions:
    k = len(out_specs)

    def draw(scale):
        return np.array([rng.random() * scale for _ in range(k)])

    zero = np.zeros(k)
    if parameter:
        return NodeOptions(
            name, "placeholder", "parameter", [], [TensorInfo(shape, 4, True)], [()] * k,
            out_specs, zero, zero, zero, draw(100.0), draw(60.0), zero, zero, zero, zero,
            zero, zero)
    return NodeOptions(
        name, "op", "einsum", inputs, [TensorInfo(shape, 4, True)], in_specs, out_specs,
        draw(1e-5), draw(1e-5), draw(1e-5), draw(30.0), zero, draw(10.0), draw(100.0),
        draw(50.0), draw(50.0), draw(80.0), draw(20.0))
