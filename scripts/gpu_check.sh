#!/usr/bin/env bash
# kvpush on an NVIDIA GPU in one prepared run (issue 16). Run it in the repository root.
#
#   bash scripts/gpu_check.sh --prepare-wheels   # HERE (PyPI reachable): the wheels the GPU machine lacks
#                                                # into .whl/ (git-ignored; carry it to the GPU machine)
#   bash scripts/gpu_check.sh                    # ON THE GPU MACHINE (no network needed when .whl/ is there)
#                                                # device tool: run(command="bash scripts/gpu_check.sh",
#                                                #   carry=[".whl"], timeout_s=560), results come back from $OUT
#   bash scripts/gpu_check.sh --dry-run          # HERE, no GPU: every step's wiring on the CPU, tiny sizes
#
# Steps (each has its own time limit, all share one budget; a failed step is recorded and the next one
# runs anyway):
#   info       nvidia-smi, the interpreter, torch and its CUDA build
#   install    nixl 1.5.1 (the lean install: nixl + nixl-cuXX matching torch's CUDA major, no deps) and any
#              other missing dependency, from .whl/ or else from the package index, into .gpu-site/
#   model      the gpu-1b preset (~1.04B parameters, random weights, bfloat16, drawn on the GPU)
#   tests      pytest: engine vs transformers and greedy parity (batched, chunked, prefix, preemption) on
#              cuda; NIXL VRAM across two processes; 1P1D pull/push/push-layerwise on the GPU vs colocated
#   bandwidth  benchmarks/transfer_bw.py --device cuda: VRAM->VRAM, kvpush's write vs a bare NIXL WRITE
#   ttft       benchmarks/layerwise_ttft.py --interleave on gpu-1b in bfloat16: colocated / pull / push /
#              push-layerwise all up at once on the GPU, one request at a time, modes taking turns
#
# Output: ONE results file, $OUT/gpu_check.md (OUT unset: ./gpu-results/), with every step's status, time
# and output tail, plus gpu_check_logs.tar.gz with the full logs.
#
# Python: GPU_CHECK_PYTHON if set, else the first of /opt/torch/.venv/bin/python3, python3, python3.12,
# python3.11 whose torch sees a GPU. When none does, a venv .gpu-venv/ gets torch==2.13.0 (the pinned
# version) from the CUDA wheel index matching the driver, then from PyPI (needs network). A preinstalled
# torch of another version is used as is and named in the results.
# Environment: OUT, GPU_CHECK_BUDGET_S (default 480; dry run 1500), GPU_CHECK_PYTHON,
# GPU_CHECK_CUDA_MAJOR (for --prepare-wheels: 13 by default, the GPU image's torch is +cu130).

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1

MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --prepare-wheels) MODE=prepare ;;
  "") ;;
  *) echo "usage: bash scripts/gpu_check.sh [--dry-run | --prepare-wheels]" >&2; exit 2 ;;
esac
[ "${GPU_CHECK_DRY_RUN:-0}" = 1 ] && MODE=dry

if [ "$MODE" = prepare ]; then
  major=${GPU_CHECK_CUDA_MAJOR:-13}
  mkdir -p .whl
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "nixl==$NIXL_VERSION" "nixl-cu$major==$NIXL_VERSION" msgspec || exit 1
  du -sh .whl
  echo "carry .whl to the GPU machine (it must stay under the 64 MiB working-tree limit with the repo)"
  exit 0
fi

OUT_DIR=${OUT:-$REPO/gpu-results}
mkdir -p "$OUT_DIR"
RESULTS=$OUT_DIR/gpu_check.md
WORK=$(mktemp -d /tmp/kvpush-gpu-check.XXXXXX)
LOGS=$WORK/logs
mkdir -p "$LOGS"
SITE=$REPO/.gpu-site
if [ "$MODE" = dry ]; then
  BUDGET=${GPU_CHECK_BUDGET_S:-1500}
  DEVICE=cpu
else
  BUDGET=${GPU_CHECK_BUDGET_S:-480}
  DEVICE=cuda
fi
START=$(date +%s)
DEADLINE=$((START + BUDGET))
FAILED=()
export PYTHONUNBUFFERED=1 KVPUSH_MODEL_DIR="$WORK/models"
export MODE REPO SITE TORCH_VERSION NIXL_VERSION

say() { printf '%s\n' "$*" >>"$RESULTS"; }
log() { printf '[gpu_check %(%H:%M:%S)T] %s\n' -1 "$*"; }

# step NAME CAP_S CMD... : run CMD with min(CAP_S, what is left of the budget); record status and tail.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - $(date +%s)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 5 ]; then
    say "## $name: SKIPPED (the ${BUDGET} s budget is spent)"
    FAILED+=("$name")
    return 1
  fi
  log "$name (limit ${limit} s)"
  local t0 rc status
  t0=$(date +%s)
  if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash
    timeout --kill-after=10 "$limit" bash -c "$(declare -f "$1" has_cuda_torch); \"\$@\"" _ "$@" \
      >"$LOGS/$name.log" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  fi
  rc=$?
  case $rc in
    0) status=OK ;;
    124 | 137) status="TIMEOUT after ${limit} s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" -ne 0 ] && FAILED+=("$name")
  say "## $name: $status, $(($(date +%s) - t0)) s"
  say ""
  say '```'
  tail -n "${TAIL_LINES:-40}" "$LOGS/$name.log" >>"$RESULTS"
  say '```'
  say ""
  log "$name: $status"
  return "$rc"
}

has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

pick_python() {  # prints the interpreter to use; may build .gpu-venv with the pinned CUDA torch
  if [ "$MODE" = dry ]; then
    echo "${GPU_CHECK_PYTHON:-$REPO/.venv/bin/python}"
    return
  fi
  local c
  for c in ${GPU_CHECK_PYTHON:-} /opt/torch/.venv/bin/python3 python3 python3.12 python3.11; do
    if command -v "$c" >/dev/null 2>&1 && has_cuda_torch "$c"; then
      command -v "$c"
      return
    fi
  done
  # No CUDA torch on the machine: the pinned version from the wheel index matching the driver, then PyPI.
  local cuda index
  cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9]*\)\.\([0-9]*\).*/\1\2/p' | head -1)
  if [ "${cuda:-0}" -ge 130 ]; then index=cu130; elif [ "${cuda:-0}" -ge 128 ]; then index=cu128; else index=cu126; fi
  python3 -m venv "$REPO/.gpu-venv" >&2 || return 1
  timeout 300 "$REPO/.gpu-venv/bin/pip" install -q "torch==$TORCH_VERSION" \
      --index-url "https://download.pytorch.org/whl/$index" >&2 ||
    timeout 300 "$REPO/.gpu-venv/bin/pip" install -q "torch==$TORCH_VERSION" >&2
  echo "$REPO/.gpu-venv/bin/python"
}

: >"$RESULTS"
say "# kvpush GPU check ($MODE run)"
say ""
say "- started: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); budget ${BUDGET} s; device: $DEVICE"
say "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git)')"
if [ "$MODE" = gpu ]; then
  say "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
else
  say "- dry run: no GPU; the same steps on the CPU with tiny sizes (proves the script, measures nothing)"
fi

PY=$(pick_python)
export PY
say "- python: ${PY:-none found}"
say ""
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------- info
info() {
  if [ "$MODE" = gpu ]; then
    nvidia-smi || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv || true
  fi
  uname -a
  nproc
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "built for CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
EOF
}
step info 60 info

# ---------------------------------------------------------------- install
install_deps() {
  local major need=()
  major=$("$PY" -c 'import torch; print((torch.version.cuda or "12").split(".")[0])') || return 1
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)') (pinned: $TORCH_VERSION); nixl-cu$major"
  if [ "$MODE" = dry ]; then
    echo "dry run: the interpreter's own environment (make install) is used; nothing is installed"
  else
    "$PY" -c 'import nixl._api' 2>/dev/null || need+=("nixl==$NIXL_VERSION" "nixl-cu$major==$NIXL_VERSION")
    "$PY" -c 'import msgspec' 2>/dev/null || need+=(msgspec)
    local mod pkg
    for pair in aiohttp:aiohttp safetensors:safetensors tokenizers:tokenizers jinja2:jinja2 \
        prometheus_client:prometheus-client tqdm:tqdm numpy:numpy transformers:transformers \
        pytest:pytest pytest_timeout:pytest-timeout matplotlib:matplotlib; do
      mod=${pair%%:*} pkg=${pair#*:}
      "$PY" -c "import $mod" 2>/dev/null || need+=("$pkg")
    done
    if [ "${#need[@]}" -gt 0 ]; then
      echo "installing into $SITE: ${need[*]}"
      mkdir -p "$SITE"
      "$PY" -m pip install -q --no-deps --no-compile --upgrade --target "$SITE" --no-index --find-links "$REPO/.whl" \
          "${need[@]}" ||
        timeout 120 "$PY" -m pip install -q --no-deps --no-compile --upgrade --target "$SITE" "${need[@]}" ||
        { echo "cannot install ${need[*]}: carry .whl (bash scripts/gpu_check.sh --prepare-wheels)"; return 1; }
    fi
  fi
  "$PY" - <<'EOF'
import nixl._api, msgspec, torch
import kvpush
from kvpush.transfer.nixl_agent import NixlTransferAgent
from kvpush.config import ucx_environment
print("nixl from", nixl._api.__file__)
print("kvpush from", kvpush.__file__)
print("UCX for VRAM:", ucx_environment(gpu=True))
agent = NixlTransferAgent("gpu-check-smoke", "VRAM" if torch.cuda.is_available() else "DRAM")
agent.close()
print("a nixl agent with the UCX backend was created")
EOF
}
step install 150 install_deps

# ---------------------------------------------------------------- model
MODEL=$WORK/models/gpu-1b
if [ "$MODE" = dry ]; then
  step model 240 "$PY" -m kvpush.cli make-model "$MODEL" --preset tiny --dtype bfloat16
else
  step model 150 "$PY" -m kvpush.cli make-model "$MODEL" --preset gpu-1b --dtype bfloat16 --init-device cuda
fi

# ---------------------------------------------------------------- tests
if [ "$MODE" = dry ]; then
  PYTEST_SELECT=(-k cpu --cpu-twins)
else
  PYTEST_SELECT=(-k cuda)
fi
TESTS_CAP=240
[ "$MODE" = dry ] && TESTS_CAP=450  # the cpu twins start 7 servers on 2 shared cores
TAIL_LINES=60 step tests "$TESTS_CAP" "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 300 \
  tests/test_engine.py tests/test_gpu.py "${PYTEST_SELECT[@]}"

# ---------------------------------------------------------------- bandwidth
if [ "$MODE" = dry ]; then
  step bandwidth 240 "$PY" benchmarks/transfer_bw.py --device cpu --sizes 1,8 --bytes-per-size 2e6 \
    --min-iters 3 --max-iters 5
else  # gpu-1b's block: 20 layers x 2 x 16 tokens x 8 heads x 128 x 2 B = 1.25 MiB
  step bandwidth 100 "$PY" benchmarks/transfer_bw.py --device cuda --num-layers 20 --block-size 16 \
    --num-kv-heads 8 --head-dim 128 --dtype-bytes 2 --sizes 1,8,64,512 --bytes-per-size 2e9 --max-iters 200
fi

# ---------------------------------------------------------------- ttft
if [ "$MODE" = dry ]; then
  TAIL_LINES=25 step ttft 600 "$PY" benchmarks/layerwise_ttft.py --model "$MODEL" --device cpu --dtype bfloat16 \
    --interleave --modes colocated pull push --lengths 32 64 --repeats 1 --kv-cache-memory-mb 16 \
    --log-dir "$WORK/ttft"
else
  TAIL_LINES=25 step ttft 240 "$PY" benchmarks/layerwise_ttft.py --model "$MODEL" --device cuda --dtype bfloat16 \
    --interleave --modes colocated pull push push-layerwise --lengths 512 2048 8192 --repeats 5 \
    --kv-cache-memory-mb 4096 --log-dir "$WORK/ttft"
fi

# ---------------------------------------------------------------- summary
[ "$MODE" = gpu ] && nvidia-smi --query-compute-apps=pid,used_memory --format=csv >"$LOGS/leftover_gpu_processes.txt" 2>&1
cp -r "$WORK/ttft" "$LOGS/ttft" 2>/dev/null
tar -czf "$OUT_DIR/gpu_check_logs.tar.gz" -C "$WORK" logs 2>/dev/null
say "## summary: $(($(date +%s) - START)) s; failed or skipped: ${FAILED[*]:-none}"
log "results: $RESULTS"
rm -rf "$WORK"
[ "${#FAILED[@]}" -eq 0 ]
