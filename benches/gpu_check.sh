#!/usr/bin/env bash
# The checks a session lent a GPU runs in one device call (ARCHITECTURE.md,
# "On a GPU"). Prepare here first, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   maturin build --release -i python3.12 -o .whl
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl highspy==<version here>
# then run there: `bash benches/gpu_check.sh [seconds, default 400]`, carrying .whl.
# Each part has its own limit and pytest is stopped with SIGINT, so that every
# log under $OUT (or ./gpu-logs) comes back with its summary.
BUDGET_S=${1:-400}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
rm -rf python  # the tests import the installed wheel, as CI does
{ nvidia-smi -L; nproc; python3 -c "import automap, torch, transformers; print(automap.__file__, torch.__version__, transformers.__version__, torch.cuda.is_available())"; } > "$OUT/env.log" 2>&1
# The math libraries' workspaces (stop 53): measured against torch's defaults.
python3 -c "import torch; from automap.cluster.workspace import *; c = torch.cuda.get_device_capability(); print('capability', c, 'workspaces measured', measure_library_workspace_bytes('cuda'), 'modelled', modelled_library_workspace_bytes(c))" >> "$OUT/env.log" 2>&1
T0=$(date +%s)
T=$((BUDGET_S - 20))
# The suite: single-process tests spread over workers; the multiprocess ones in
# two runs side by side (they run one after another within a run), without the
# torch.compile ones (minutes each there; run them in a call of their own).
# Twice: with the GPU hidden, as CI runs them (meshes without a backend plan
# for gloo's CPUs), and with it visible, where such meshes plan for NCCL's
# GPUs, whose cuBLAS workspaces (about 66 MiB on Hopper) come off every budget:
# tests with budgets of a few MiB fail there by design; the GPU-only tests run.
CUDA_VISIBLE_DEVICES= timeout -s INT $T python3 -m pytest -q -n 5 -m "not multiprocess" \
  -rfE --tb=short > "$OUT/suite_single.log" 2>&1 &
timeout -s INT $T python3 -m pytest -q -n 5 -m "not multiprocess" -rfEs --tb=line \
  > "$OUT/suite_single_gpu_visible.log" 2>&1 &
timeout -s INT $T python3 -m pytest -v -n 0 -m multiprocess -rfE --tb=short \
  tests/generate tests/sharding tests/checkpoint --deselect tests/generate/test_compile_gloo.py \
  > "$OUT/suite_mp_a.log" 2>&1 &
timeout -s INT $T python3 -m pytest -v -n 0 -m multiprocess -rfE --tb=short \
  tests/api tests/planner tests/models tests/solve tests/cluster tests/trace tests/cli \
  > "$OUT/suite_mp_b.log" 2>&1 &
# The benches: predicted peaks against torch.cuda.max_memory_allocated.
timeout 150 python3 benches/trust_gpu.py > "$OUT/trust_gpu_1.log" 2>&1
echo "exit $? after $(( $(date +%s) - T0 )) s" >> "$OUT/trust_gpu_1.log"
timeout 150 python3 benches/trust_gpu.py mlp gpt2 resnet --ranks 4 --quick > "$OUT/trust_gpu_4.log" 2>&1
echo "exit $? after $(( $(date +%s) - T0 )) s" >> "$OUT/trust_gpu_4.log"
timeout 100 python3 benches/profile_accuracy.py > "$OUT/profile_accuracy.log" 2>&1
echo "exit $? after $(( $(date +%s) - T0 )) s" >> "$OUT/profile_accuracy.log"
wait
echo "all done after $(( $(date +%s) - T0 )) s" >> "$OUT/env.log"
