"""The model matrix (issue 16): every model of ``tests/support/model_matrix.py``
(decoder LMs, a mixture of experts, encoders, encoder-decoders, vision,
recurrent and hand-written models; tiny configs, random weights) traced,
planned on a (2, 2) mesh and trained 3 AdamW steps in float64 on 4 gloo ranks
next to the serial model, one process group per family. Prints per model the
planning seconds, graph nodes, nodes with a split output, the share of the
step's FLOPs run replicated, the ops rewritten for their splits and the
largest relative loss and gradient differences.

    python benches/train_model_matrix.py [--families decoder,vision] [--models gpt2,unet]

The test suite trains a third of it (``tests/models/test_model_matrix.py``);
``pytest -m model_matrix`` runs all of it as tests.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(here, "..", "tests", "support"),
                os.path.join(here, "..", "tests", "models")]


def main() -> None:
    from automap.launch import run_on_gloo
    from matrix_workers import HEADER, format_row, train_family
    from model_matrix import MATRIX

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(MATRIX))
    parser.add_argument("--models", default="")
    args = parser.parse_args()
    wanted = set(args.models.split(",")) if args.models else None
    print(HEADER)
    start = time.perf_counter()
    for family in args.families.split(","):
        names = [n for n in MATRIX[family] if wanted is None or n in wanted]
        if not names:
            continue
        print(f"-- {family}")
        for row in run_on_gloo(train_family, 4, names, (2, 2), timeout_s=1800)[0]:
            print(format_row(row), flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
