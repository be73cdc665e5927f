#!/usr/bin/env bash
# The GPU run behind docs/benchmarks.md's "GPU: cosine bench engine" section, in one call of at most 6 minutes on one
# H100 or H200 (so that a rerun fits 15 minutes of device time with the machine's start): `cosine bench engine` on
# the torch engine (vLLM's CUDA wheel is too large to travel) with the trained target widened to 9.16B parameters
# (--target-scale 16 20), bf16, 12 held-out prompts, 64 new tokens, greedy, at batch 1 and 8, 3 repeats;
# target-only, the chain with the domain drafter, with the generic drafter, with the goodput controller, and full
# CoSine, each with drafting overlapping verification and without (speculation.colocated_overlap on / off); the
# drafter pool on (one CUDA graph replay per depth); the draft timeout as shipped (the config's, relative to the
# verify step). The JSON is written after every repeat, with its provenance, to $OUT, with the log (Python
# unbuffered: what ran comes back if the call is cut off); the run stops at TIME_LIMIT_S (the JSON then holds the
# repeats done, `config.repeats_done`). Per method the rows say how many prompts' outputs equal target-only's and
# where the others first differ (`identity`), and how many graph captures happened in the timed runs (must be 0).
#
# Provenance: `.git` does not travel to the device machine, so the caller reads the commit and whether the tree
# matched it before the call and passes them in (results under bench_results/ and docs/img/ do not count, as in
# benchmarks/provenance.py):
#   COSINE_COMMIT=$(git rev-parse HEAD)
#   COSINE_DIRTY=$(git status --porcelain --untracked-files=no -- . ':(exclude)bench_results' ':(exclude)docs/img' \
#     | grep -q . && echo 1 || echo 0)
# Wheels the device image lacks travel in .gpu-wheels (ignored by git, carried), fetched here before the call for
# CPython 3.12 on x86_64 Linux: pydantic (py3-none-any) with pydantic-core's compiled wheel
# (cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64) and their pure dependencies (annotated-types,
# typing-extensions, typing-inspection); psutil (cp36-abi3-manylinux_2_12_x86_64, which a manylinux_2_17 platform
# accepts); pyyaml (cp312-cp312-manylinux_2_17_x86_64); simpy, prometheus-client, httpx (with anyio, certifi,
# httpcore, h11, idna) and tqdm (py3-none-any):
#   pip download --only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu-wheels \
#     pydantic pydantic-core psutil simpy prometheus-client httpx pyyaml tqdm
#   run(command="COSINE_COMMIT=... COSINE_DIRTY=... OUT=\$OUT bash benchmarks/gpu_engine.sh", carry=[".gpu-wheels"],
#       timeout_s=420)
# DRY_RUN=1: the same steps on the CPU at a tiny size (tests/test_gpu_script.py runs it, so that it cannot rot).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT, the folder the results go to}"
: "${COSINE_COMMIT:?set COSINE_COMMIT (git rev-parse HEAD, read before the call)}"
: "${COSINE_DIRTY:?set COSINE_DIRTY (1: the tree differed from the commit, 0: it did not)}"
export COSINE_COMMIT COSINE_DIRTY PYTHONUNBUFFERED=1
if [ "${DRY_RUN:-0}" = 1 ]; then
  DEVICE=cpu SCALE="1 4" DTYPE=float32 NEW=3 PER=1 REPEATS=1 BATCHES="1" LIMIT=${TIME_LIMIT_S:-300}
else
  DEVICE=cuda SCALE="16 20" DTYPE=bfloat16 NEW=64 PER=2 REPEATS=3 BATCHES="1 8" LIMIT=${TIME_LIMIT_S:-320}
fi
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-index --find-links .gpu-wheels pydantic psutil simpy prometheus-client httpx pyyaml tqdm
fi
export PYTHONPATH=$PWD
echo "commit $COSINE_COMMIT, dirty $COSINE_DIRTY, $DEVICE, limit ${LIMIT} s" | tee "$OUT/engine-9b.log"
methods=("ours: chain, domain" "ours: chain, generic" "ours: chain, goodput" "full CoSine (routing")
status=0
# shellcheck disable=SC2086  # SCALE and BATCHES are lists of numbers
timeout --signal=INT "$LIMIT" "$PY" -u -m serve_app.cli bench engine --device "$DEVICE" --target-scale $SCALE \
  --no-hf --new-tokens "$NEW" --per-domain "$PER" --pool on --overlap on off --methods "${methods[@]}" \
  --dtype "$DTYPE" --batches $BATCHES --repeats "$REPEATS" --json "$OUT/engine-9b.json" 2>&1 \
  | grep --line-buffered -v "Loading weights" | tee -a "$OUT/engine-9b.log" || status=$?
if [ "$status" = 124 ]; then
  echo "stopped at the ${LIMIT} s limit: $OUT/engine-9b.json holds the repeats done" | tee -a "$OUT/engine-9b.log"
elif [ "$status" != 0 ]; then
  exit "$status"
fi
