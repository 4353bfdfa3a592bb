#!/usr/bin/env bash
# One prepared GPU run: build, the CUDA test suites, the kernel benchmarks, 2 ranks on one GPU
# over gloo against the same run on CPU tensors; one JSON and one Markdown report in OUT.
#
#   bash benchmarks/gpu_check.sh "$OUT"             # on a CUDA machine: <= 8 minutes on one H100
#   bash benchmarks/gpu_check.sh "$OUT" --dry-run   # anywhere: runs what needs no CUDA, prints the rest
#
# The device image lacks Hydra (tests/conftest.py needs it): before the device call, here in the repository root,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.2 omegaconf==2.3.0
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3    # PyPI has no wheel of it
# and name .whl in the call's carry; this script installs them into a private target.
#
# OUT receives gpu_check.json, gpu_check.md, gpu_check.log and kernels_cuda.json (copy it to benchmarks/results/
# for the results page) only (a device run brings back <= 8 files);
# the steps' own files stay in a temporary work folder. Every step runs under `timeout`; a failed step is
# recorded and the script goes on, so one run reports everything it could. Exit status 0 iff all passed.
set -uo pipefail

OUT="${1:?usage: bash benchmarks/gpu_check.sh OUT [--dry-run]}"
DRY=0
[[ "${2:-}" == "--dry-run" ]] && DRY=1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
LOG="$OUT/gpu_check.log"
: >"$LOG"
STARTED=$SECONDS

# The device image's default CXX links libstdc++ statically, which the loader refuses (docs/benchmarks.md).
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
PYTEST_TIMEOUT=120  # seconds per test

# The device image has torch, Lightning, Accelerate and transformers but not Hydra, which tests/conftest.py
# imports: wheels carried in .whl/ (see docs/benchmarks.md "On a CUDA GPU") go into a private target first.
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$ROOT"/.whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi

say() { echo "[gpu_check $((SECONDS - STARTED))s] $*" | tee -a "$LOG"; }

# step NAME LIMIT CMD...: run under timeout, output to WORK/NAME.log, one line in steps.tsv.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  say "$name: $*"
  timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  local note="ok"
  [[ $rc -eq 124 || $rc -eq 137 ]] && note="timed out after ${limit}s"
  [[ $rc -ne 0 && $note == ok ]] && note="$(grep -m1 -E 'Error|error|FAILED|failed' "$WORK/$name.log" | cut -c1-160 | tr '\t|' '  ')"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$note" >>"$WORK/steps.tsv"
  { echo "----- $name (exit $rc) -----"; tail -c 1000000 "$WORK/$name.log"; } >>"$LOG"
  say "$name: exit $rc after $((SECONDS - t0))s"
  return $rc
}

# would NAME CMD...: in a dry run, say what the GPU run does instead of doing it.
would() {
  local name=$1
  shift
  say "dry run, $name would run: $*"
  printf '%s\t-\t0\t%s\n' "$name" "dry run: needs CUDA" >>"$WORK/steps.tsv"
}

gpu_or_dry() {  # gpu_or_dry NAME LIMIT CMD...
  if ((DRY)); then would "$1" "${@:3}"; else step "$@"; fi
}

# ---------------------------------------------------------------- 0. the machine
"$PY" - "$DRY" >"$WORK/meta.json" <<'EOF'
import json, sys, torch
cuda = torch.cuda.is_available()
meta = dict(mode="dry run (CPU)" if sys.argv[1] == "1" else "GPU run", torch=torch.__version__,
            cuda=torch.version.cuda, cuda_available=cuda)
if cuda:
    p = torch.cuda.get_device_properties(0)
    meta["device"] = f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"
print(json.dumps(meta))
EOF
say "machine: $(cat "$WORK/meta.json"); CXX=${CXX:-unset}; work folder $WORK"
if ((!DRY)) && ! grep -q '"cuda_available": true' "$WORK/meta.json"; then
  say "no CUDA GPU here: run with --dry-run"
  exit 2
fi

# ---------------------------------------------------------------- 1. build (CPU + CUDA kernels where CUDA is)
step build 420 "$PY" -m lightning_optim.ops build
if ((!DRY)); then
  step build_has_cuda 60 "$PY" -c "from lightning_optim import ops; import sys; sys.exit(0 if ops.build().with_cuda() else 1)"
fi

# ---------------------------------------------------------------- 2. tests + the 2-rank runs, in parallel
SUITES=(tests/ops tests/onebit tests/precision tests/distributed_optim)
IGNORE=(--ignore=tests/ops/test_build_cache.py)  # it compiles extensions again and again: CI's, not the GPU's
COMMON=(-q -p no:cacheprovider --timeout "$PYTEST_TIMEOUT" -o junit_family=xunit1 --tb=line "${IGNORE[@]}")
ranks() {  # ranks DEVICE PORT: the command line of one 2-rank run
  RANKS=(torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$2"
         benchmarks/gpu_check_ranks.py --device "$1" --out "$WORK/ranks_$1")
}

pids=()
if ((DRY)); then
  # the suites' selection, collected here (what the GPU run executes, CUDA parametrisations included)
  step collect 300 "$PY" -m pytest --collect-only "${COMMON[@]}" "${SUITES[@]}" &
  pids+=($!)
  would tests "$PY" -m pytest -n 8 --dist loadfile ${COMMON[*]} --junitxml WORK/junit_ops.xml tests/ops \
    "&" "$PY" -m pytest -n 6 --dist loadfile ${COMMON[*]} --junitxml WORK/junit_rest.xml tests/onebit tests/precision tests/distributed_optim
  ranks cuda 29631
  would ranks_cuda "${RANKS[@]}"
else
  if "$PY" -c "import xdist" 2>/dev/null; then  # pytest-xdist is in the device image (docs/benchmarks.md)
    step tests_ops 330 "$PY" -m pytest -n 8 --dist loadfile "${COMMON[@]}" --junitxml "$WORK/junit_ops.xml" tests/ops &
    pids+=($!)
    step tests_rest 330 "$PY" -m pytest -n 6 --dist loadfile "${COMMON[@]}" --junitxml "$WORK/junit_rest.xml" \
      tests/onebit tests/precision tests/distributed_optim &
    pids+=($!)
  else  # no xdist: one pytest per suite, side by side
    for suite in "${SUITES[@]}"; do
      name="tests_${suite#tests/}"
      step "$name" 330 "$PY" -m pytest "${COMMON[@]}" --junitxml "$WORK/junit_${suite#tests/}.xml" "$suite" &
      pids+=($!)
    done
  fi
  ranks cuda 29631
  step ranks_cuda 180 "${RANKS[@]}" &
  pids+=($!)
fi
ranks cpu 29632
step ranks_cpu 180 "${RANKS[@]}" &
pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done

# ---------------------------------------------------------------- 3. kernel benchmarks (alone on the GPU)
# the kernels' figures also as benchmarks/results/kernels_cuda.json (machine facts included), brought back in OUT
gpu_or_dry kernels 240 env LIGHTNING_OPTIM_RESULTS="$OUT" "$PY" benchmarks/kernels_cuda.py --json "$WORK/kernels.json"

# ---------------------------------------------------------------- 4. the report
step report 120 "$PY" benchmarks/gpu_check_report.py "$WORK" "$OUT"
cat "$OUT/gpu_check.md" 2>/dev/null
say "done in $((SECONDS - STARTED))s; report in $OUT (work files in $WORK)"
"$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$OUT/gpu_check.json"
