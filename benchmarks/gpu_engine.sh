#!/usr/bin/env bash
# The GPU run behind docs/benchmarks.md's "GPU: cosine bench engine" section, in one call of under 8 minutes on one
# H100 or H200: `cosine bench engine` on the trained target widened to 9.16B parameters (--target-scale 16 20), 12
# held-out prompts, 64 new tokens, greedy; bf16 at batch 1, 8 and 16 (2 repeats) and fp32 at batch 1 and 8 (1
# repeat); target-only, the chain with the domain drafter, with the generic drafter, with the goodput controller, and
# full CoSine; the drafter pool on (one CUDA graph replay per depth). Each JSON is written after every repeat, with
# its provenance, to $OUT, with the log; per method the rows say how many prompts' outputs equal target-only's and
# where the others first differ (`identity`), and how many graph captures happened in the timed runs (must be 0).
#
# On a GPU machine (the device tool), from the repository root, the wheels the image lacks carried along:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --implementation cp -d .gpu-wheels pydantic psutil simpy prometheus-client httpx pyyaml tqdm
#   run(command="bash benchmarks/gpu_engine.sh", carry=[".gpu-wheels"], timeout_s=560)
# A dry run here, on the CPU at a tiny size:
#   OUT=/tmp/gpu-dry DEVICE=cpu SCALE="1 4" NEW_TOKENS=8 PER_DOMAIN=1 REPEATS=1 bash benchmarks/gpu_engine.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT, the folder the results go to}"
DEVICE=${DEVICE:-cuda} SCALE=${SCALE:-16 20} NEW=${NEW_TOKENS:-64} PER=${PER_DOMAIN:-2} REPEATS=${REPEATS:-2}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-index --find-links .gpu-wheels pydantic psutil simpy prometheus-client httpx pyyaml tqdm
fi
export PYTHONPATH=$PWD
methods=("ours: chain, domain" "ours: chain, generic" "ours: chain, goodput" "full CoSine (routing")
bench() {
  # shellcheck disable=SC2086  # SCALE is two numbers
  "$PY" -m serve_app.cli bench engine --device "$DEVICE" --target-scale $SCALE --no-hf --new-tokens "$NEW" \
    --per-domain "$PER" --pool on --methods "${methods[@]}" "$@"
}
bench --dtype bfloat16 --batches 1 8 16 --repeats "$REPEATS" --json "$OUT/engine-9b-bf16.json" 2>&1 \
  | grep -v "Loading weights" | tee "$OUT/engine-9b-bf16.log"
bench --dtype float32 --batches 1 8 --repeats 1 --json "$OUT/engine-9b-fp32.json" 2>&1 \
  | grep -v "Loading weights" | tee "$OUT/engine-9b-fp32.log"
