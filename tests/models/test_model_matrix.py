"""Issue 16, acceptance 3: current models train like the serial model. Each
model of the matrix (``tests/support/model_matrix.py``) traces, plans on a
(2, 2) mesh with no op left without a strategy, and trains 3 AdamW steps on 4
gloo ranks in float64 with the serial model's losses and gradients (relative
1e-5: float32 parts inside the float64 models, see TOL) at every step. The
suite trains a representative third in one process group; ``pytest -m
model_matrix`` trains all of it, one process group per family (so does
``benches/train_model_matrix.py``, as a table)."""

from __future__ import annotations

import pytest

from automap.launch import run_on_gloo
from matrix_workers import format_row, train_family
from model_matrix import CI_MODELS, MATRIX, count

pytestmark = pytest.mark.multiprocess

#: Relative. The models run in float64, but some compute parts in float32
#: whatever the model's dtype (Phi-3's, Llama's and Mixtral's RMSNorm upcast to
#: float32 and cast back), so a plan that splits such a reduction rounds
#: differently in float32: phi3 has come out at 2.7e-6 in one CI run and far
#: below 1e-6 in the others, when the plan depended on a measured profile (the
#: matrix now plans with every speed given, so one plan per model).
TOL = 1e-5


def _check(rows: list[dict]) -> list[str]:
    failures = []
    for r in rows:
        print(format_row(r))
        name = r["model"]
        if "error" in r:
            failures.append(f"{name}: {r['error']}\n{r['traceback']}")
            continue
        checks = [
            (not r["unsupported"], f"ops without a strategy: {r['unsupported']}"),
            (r["loss_rel"] <= TOL, f"losses differ by {r['loss_rel']:.1e}"),
            (r["grad_rel"][0] <= TOL, f"gradient {r['grad_rel'][1]} differs by "
                                      f"{r['grad_rel'][0]:.1e}"),
            (not r["missing"], f"no gradient for {r['missing']}"),
        ]
        failures += [f"{name}: {msg}" for ok, msg in checks if not ok]
    return failures


@pytest.mark.timeout(60)
def test_matrix_has_every_family():
    assert count() >= 20
    assert set(CI_MODELS) <= set(MATRIX)
    assert count(CI_MODELS) * 3 >= count()


@pytest.mark.timeout(900)
def test_representative_third_trains_like_serial():
    names = [n for family in CI_MODELS.values() for n in family]
    rows = run_on_gloo(train_family, 4, names, (2, 2), timeout_s=800)[0]
    failures = _check(rows)
    assert not failures, "\n".join(failures)


@pytest.mark.model_matrix
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("family", sorted(MATRIX))
def test_full_matrix_trains_like_serial(family, request):
    if "model_matrix" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full matrix runs with -m model_matrix (or benches/train_model_matrix.py)")
    rows = run_on_gloo(train_family, 4, list(MATRIX[family]), (2, 2), timeout_s=1700)[0]
    failures = _check(rows)
    assert not failures, "\n".join(failures)
