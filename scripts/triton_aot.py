"""graphrt's Triton kernels compiled ahead of time for the GPU check's H200 (sm_90), on a machine
without a GPU, so scripts/gpu_check.sh carries a warm TRITON_CACHE_DIR instead of compiling in its minutes.

    .venv/bin/python scripts/triton_aot.py record     # 1. the launches the check makes, found on the CPU
    python3 scripts/triton_aot.py setup               # 2. .venv-triton36: python 3.12 + triton 3.6.0, as the GPU image
    .venv-triton36/bin/python scripts/triton_aot.py compile   # 3. every variant compiled for sm_90
    python3 scripts/triton_aot.py all                 # the three in turn
    python3 scripts/triton_aot.py merge DIR/triton-compiled-here.tar.gz   # what a GPU check still compiled

Everything lands in .triton-aot/ (git-ignored): launches.json (step 1), triton-cache-sm90.tar.gz and
manifest.json (step 3). The device tool carries it: carry [".whl", ".triton-aot"]; gpu_check.sh
unpacks the archive into its TRITON_CACHE_DIR and reports how many kernels it still had to compile.

1. `record` finds the variants from the code, not from a list: every `@triton.jit` kernel launch in
   graphrt.kernels is intercepted (KernelInterface.__getitem__) and described as the JIT specializes
   it (tensor dtypes and 16-byte alignment, ints as 1 / multiple of 16 / other, constexprs, options)
   while the check's workloads run on the CPU: tests/kernels/test_kernels.py, test_moe_triton.py and test_mla_triton.py
   through Triton's interpreter (with a bfloat16 twin of each float16 launch: the tests add bfloat16
   on CUDA), benchmarks/kernels_gpu.py's cases, and the engines that `graphrt capture` / `generate` /
   `serve`, graph_replay_gpu.py and pp_throughput_gpu.py build (their own build functions, on the CPU
   with kernels="triton"; a launch is recorded, not run, and the torch reference computes the
   result), and, as the check's engines run no MoE or MLA model, the fused-MoE kernels at each decode
   bucket for each MoE family's routing (record_moe_layers) and MLA's latent decode attention at each
   decode bucket at DeepSeek-V3's widths (record_mla_layers).
   Decode attention's split count is what `default_num_splits` gives on an H200 (132 SMs).
3. `compile` runs each recorded launch through triton 3.6's own JIT path (`JITFunction.run(...,
   warmup=True)`, which compiles without launching) against a compile-only driver whose target is
   GPUTarget("cuda", 90, 32): the same binder, signature, constexprs, attributes and options as the
   JIT on the GPU, so the same cache key. It needs no torch (torch and graphrt's other modules are
   stubbed while the kernel files load) and fails if any variant does not compile for sm_90.

Will the GPU's JIT hit this cache? Triton's key (triton/runtime/cache.py get_cache_key) is
triton_key() (triton's version and the sha256 of its compiler, backend and language sources and of
libtriton.so, so the same wheel: same version AND same Python ABI, hence python 3.12 here) + the
source's hash (kernel source, line, callees, signature, constexprs, alignment attributes) + the
backend's hash (the bundled ptxas's `--version` and the arch, 90) + the options' hash (libdevice by
file content, not path) + cache-invalidating environment variables. Nothing in it reads the GPU or
the driver. It holds if the image's triton 3.6.0 is the same cp312 manylinux wheel as PyPI's and no
TRITON_PTXAS_PATH or such variable is set there; manifest.json records triton_key's sha256 and
gpu_check.sh compares it with the GPU's and counts what it still compiled.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.abc
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / ".triton-aot"
TRITON_VENV = ROOT / ".venv-triton36"
GPU_TRITON = "3.6.0"  # the GPU image's (KINDS.md in the device docs: torch 2.11.0+cu130, triton 3.6.0)
GPU_PYTHON = (3, 12)  # the GPU image's python3 (3.12.3)
GPU_ARCH, GPU_WARP_SIZE = 90, 32  # H200: compute capability 9.0
GPU_NUM_SMS = 132
KERNEL_PACKAGE = "graphrt.kernels"
ARCHIVE = "triton-cache-sm90.tar.gz"
INT32 = range(-(2**31), 2**31)


# -- 1. record --------------------------------------------------------------------------------------


def describe(value, is_constexpr: bool) -> dict:
    """One argument as the JIT specializes it, and no more (so launches that compile alike dedupe)."""
    if is_constexpr:
        if type(value).__name__ == "dtype" and type(value).__module__.startswith("triton"):
            return {"tl_dtype": value.name}
        return {"value": value}
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, bool):
        return {"bool": True}
    if isinstance(value, int):  # the JIT makes 1 a constant and marks multiples of 16
        if value == 1:
            return {"int": 1}
        return {"int": (16 if value % 16 == 0 else 3) + (0 if value in INT32 else 2**40)}
    if isinstance(value, float):
        return {"float": True}
    if value is None:
        return {"none": True}
    raise TypeError(f"triton_aot.py cannot describe a kernel argument of type {type(value).__name__}: teach describe()")


class LaunchRecorder:
    """Records every launch of a graphrt.kernels Triton kernel; `launch` says whether it also runs."""

    def __init__(self, launch: bool):
        self.launch = launch
        self.source = "?"
        self.launches: dict[str, dict] = {}

    def install(self) -> None:
        from triton.runtime.jit import KernelInterface

        original, recorder = KernelInterface.__getitem__, self

        def getitem(kernel, grid):
            def launch(*args, **kwargs):
                if kernel.fn.__module__.startswith(KERNEL_PACKAGE + "."):
                    recorder.record(kernel.fn, args, kwargs)
                    if not recorder.launch:
                        return None
                return original(kernel, grid)(*args, **kwargs)

            return launch

        KernelInterface.__getitem__ = getitem

    def record(self, fn, args, kwargs) -> None:
        signature = inspect.signature(fn)
        params = {k: v for k, v in kwargs.items() if k in signature.parameters}
        options = {k: v for k, v in kwargs.items() if k not in signature.parameters}
        bound = signature.bind(*args, **params)
        bound.apply_defaults()
        constexprs = {name for name, p in signature.parameters.items() if "constexpr" in str(p.annotation)}
        entry = {
            "kernel": f"{fn.__module__}:{fn.__qualname__}",
            "args": {name: describe(value, name in constexprs) for name, value in bound.arguments.items()},
            "options": options,
        }
        key = json.dumps({k: entry[k] for k in ("kernel", "args", "options")}, sort_keys=True)
        self.launches.setdefault(key, {**entry, "sources": []})
        if self.source not in self.launches[key]["sources"]:
            self.launches[key]["sources"].append(self.source)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(list(self.launches.values()), indent=1) + "\n")


class _OnCuda:
    """A tensor that says it is on cuda:0, for code that asks where it is and how big it is."""

    def __init__(self, tensor):
        self._tensor = tensor

    @property
    def device(self):
        import torch

        return torch.device("cuda", 0)

    def __getattr__(self, name):
        return getattr(self._tensor, name)


def split_counts_as_on_the_gpu() -> None:
    """Decode attention's default split count is what it is on an H200, whatever device the tensors are on."""
    import torch

    module = importlib.import_module(f"{KERNEL_PACKAGE}.paged_attention_triton")
    if not hasattr(module, "default_num_splits"):
        raise SystemExit("paged_attention_triton has no default_num_splits: teach triton_aot.py how decode attention splits on CUDA")
    original = module.default_num_splits
    properties = types.SimpleNamespace(multi_processor_count=GPU_NUM_SMS, name="NVIDIA H200", major=9, minor=0)

    def as_on_the_gpu(q, *args, **kwargs):
        real = torch.cuda.get_device_properties
        torch.cuda.get_device_properties = lambda device=None: properties
        try:
            return original(_OnCuda(q), *args, **kwargs)
        finally:
            torch.cuda.get_device_properties = real

    module.default_num_splits = as_on_the_gpu


def record_only_kernel_set() -> None:
    """kernels="triton" on the CPU: each op's Triton launch is recorded, its torch reference computes."""
    import dataclasses

    from graphrt.kernels import KernelSet, triton_ops
    from graphrt.kernels.torch_ops import TORCH

    def both(fast, reference):
        def call(*args, **kwargs):
            fast(*args, **kwargs)  # records its launches; nothing runs
            return reference(*args, **kwargs)

        return call

    from graphrt.runtime import stage_builder

    # A CPU stage would swap its kernel set for the CPU's compiled kernels or torch references and
    # its weights for packed forms, as a CUDA stage does not: it keeps them dense, and its set,
    os.environ["GRAPHRT_MATMUL"], os.environ["GRAPHRT_CPU_KERNELS"] = "dense", "torch"  # nothing timed
    stage_builder.cpu_kernel_set = lambda ops, choice: ops
    # and "auto" is triton, as on CUDA.
    choose = stage_builder.kernel_set
    stage_builder.kernel_set = lambda name, device_type: choose(name, "cuda" if device_type == "cpu" else device_type)
    triton = triton_ops.TRITON
    # The name as it is; the one-call decode step and the stream hook as they are: both sets have none.
    kept = ("name", "decode_layers", "stream_hook")
    triton_ops.TRITON = KernelSet(**{
        f.name: getattr(triton, f.name) if f.name in kept else both(getattr(triton, f.name), getattr(TORCH, f.name))
        for f in dataclasses.fields(KernelSet)
    })


# Test files that gpu_check.sh's pytest_cuda step runs whole, within its minute.
KERNEL_TESTS = "tests/kernels/test_kernels.py tests/kernels/test_moe_triton.py tests/kernels/test_mla_triton.py"


def record_kernel_tests(path: Path) -> None:
    """KERNEL_TESTS through the interpreter, this file as a pytest plugin that records."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_AOT_RECORD=str(path), PYTHONPATH=f"{ROOT / 'scripts'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "triton_aot", *KERNEL_TESTS.split()]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    # The tests run with the GPU's split counts, so a CPU-only assertion may fail; the launches are what count.
    print(f"  {KERNEL_TESTS} (interpreter, exit {result.returncode}): {tail}")
    if not path.exists():
        raise SystemExit(f"{KERNEL_TESTS} recorded nothing:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def pytest_configure(config):  # noqa: ARG001 - this file as the plugin of record_kernel_tests
    recorder = LaunchRecorder(launch=True)
    recorder.source = KERNEL_TESTS
    recorder.install()
    split_counts_as_on_the_gpu()
    config._triton_aot_recorder = recorder


def pytest_unconfigure(config):
    recorder = getattr(config, "_triton_aot_recorder", None)
    if recorder is not None:
        for entry in list(recorder.launches.values()):  # on CUDA the tests add bfloat16 beside float16
            args = entry["args"]
            if any(a.get("tensor") == "float16" for a in args.values()):
                twin = {n: dict(a, tensor="bfloat16") if a.get("tensor") == "float16" else a for n, a in args.items()}
                key = json.dumps({"kernel": entry["kernel"], "args": twin, "options": entry["options"]}, sort_keys=True)
                recorder.launches.setdefault(key, {**entry, "args": twin, "sources": [f"{recorder.source} (bfloat16 twin)"]})
        recorder.save(Path(os.environ["TRITON_AOT_RECORD"]))


def benchmark_module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def generate(llm, prompt_lens: list[int], max_tokens: int) -> None:
    from graphrt import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    prompts = [[3 + (7 * i + j) % (vocab - 3) for j in range(length)] for i, length in enumerate(prompt_lens)]
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def record_workloads(recorder: LaunchRecorder, scratch: Path) -> None:
    """The engines and kernel cases of gpu_check.sh's steps, on the CPU (see the steps' commands there)."""
    import torch

    from graphrt import LLM
    from graphrt.tools.synthetic import make_tiny_model

    replay = benchmark_module("graph_replay_gpu")
    throughput = benchmark_module("pp_throughput_gpu")
    kernels = benchmark_module("kernels_gpu")
    # The 1B shapes with one layer: the kernels' arguments do not depend on the layer count.
    one_b = replay.write_random_model(scratch / "llama-1b-1layer", dict(replay.LLAMA_3_2_1B, num_hidden_layers=1), device="cpu")
    tiny = make_tiny_model(scratch / "tiny", replay.TINY_VARIANT)
    cpu = dict(devices=["cpu"], kernels="triton")

    recorder.source = "graphrt capture --pp 2 / generate / serve (1B, default buckets and max_model_len)"
    # On the GPU the largest bucket comes from KV memory (up to 256); past 64 rows decode runs one split, as at 64.
    llm = LLM(model=one_b, dtype="bfloat16", max_batch=64, max_num_seqs=64, **cpu)
    for batch in llm.engine.plan.sizes:
        generate(llm, [5] * batch, 2)
    generate(llm, [40, 17], 4)
    llm.engine.close()

    recorder.source = "graph_replay_gpu.py --models 1b"
    args = replay.parse_args(["--models", "1b", "--buckets", "1,8,32,64"])
    args.device = "cpu"
    for use_graphs in (True, False):
        llm, _ = replay.build_llm(one_b, 1, args, "bfloat16", use_graphs)
        for batch in args.buckets:
            generate(llm, [args.context] * batch if batch == 1 else [16] * batch, 2)
        llm.engine.close()

    recorder.source = "pp_throughput_gpu.py"
    args = throughput.parse_args(["--pp", "1", "--batches", "1,64", "--output-len", "4"])
    args.device = "cpu"
    full = throughput.parse_args([])
    args.output_len = full.output_len  # max_model_len comes from prompt + output length
    for model_dir, dtype in ((one_b, "bfloat16"), (tiny, "float32")):
        llm = throughput.build_llm(model_dir, 1, dtype, args)
        for batch in args.batches:
            generate(llm, [args.prompt_len] * batch, 2)
        llm.engine.close()

    recorder.source = "kernels_gpu.py --batch-sizes 1,64 --contexts 1024,4096"
    for batch in (1, 64):
        for case in kernels.pointwise_cases(batch, torch.bfloat16, torch.device("cpu")):
            case.triton(*case.inputs)
        for context in (1024, 4096):
            for case in kernels.attention_cases(batch, context, torch.bfloat16, torch.device("cpu")):
                case.triton(*case.inputs)

    record_moe_layers(recorder)
    record_mla_layers(recorder)


# (experts, top-k) of the MoE families of issue 32: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 / Kimi K2.
MOE_ROUTINGS = ((8, 2), (60, 4), (128, 8), (256, 8))
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode buckets, up to the largest KV memory gives on the GPU


def record_moe_layers(recorder: LaunchRecorder) -> None:
    """kernels/moe_triton.py's fused MoE in bfloat16 at each decode bucket for each family's routing.
    The check's engines run no MoE model, so these stand in for its layers: what the JIT specializes on is the
    routing's shape (experts, top-k), the block size that the bucket picks and whether counts are 1 or
    multiples of 16; of the widths only whether they are multiples of 16 and, for the sum over top-k,
    whether hidden reaches 1024 (its tile). So hidden 1024 and inter 256 compile what 7168 and 2048 would."""
    import torch

    from graphrt.kernels import moe_triton

    recorder.source = "fused MoE at decode buckets 1-256 (Mixtral, Qwen2/3-MoE, DeepSeek-V3 routings; no MoE engine yet)"
    hidden_size, inter_size = 1024, 256
    for num_experts, top_k in MOE_ROUTINGS:
        w_gate_up = torch.empty(num_experts, 2 * inter_size, hidden_size, dtype=torch.bfloat16)
        w_down = torch.empty(num_experts, hidden_size, inter_size, dtype=torch.bfloat16)
        for bucket in DECODE_BUCKETS:
            topk_ids = torch.zeros(bucket, top_k, dtype=torch.int64)  # recorded, not run: the routing is never read
            hidden = torch.empty(bucket, hidden_size, dtype=torch.bfloat16)
            moe_triton.fused_moe(hidden, w_gate_up, w_down, torch.empty(bucket, top_k), topk_ids)


# DeepSeek-V3's MLA: kv_lora_rank 512 + qk_rope_head_dim 64 per cache row, 163840 positions (the
# graphs' block tables are max_model_len wide); 128 heads on one device, 16 on each of eight.
MLA_LATENT_DIM, MLA_ROPE_DIM, MLA_MAX_MODEL_LEN = 512, 64, 163840
MLA_HEADS = (16, 128)


def record_mla_layers(recorder: LaunchRecorder) -> None:
    """kernels/mla_triton.py's latent decode attention at each decode bucket, as a captured graph
    launches it (int64 block tables max_model_len wide, block size 16), in bfloat16 and float16.
    The check's engines run no MLA model. What the JIT specializes on besides the dtypes is the head
    tile (16 or 32, from the head count) and the split count, which the bucket and the head tiles pick
    on an H200; the rest (widths, strides, head counts: all multiples of 16) is alike at every bucket."""
    import torch

    from graphrt.kernels import mla_triton

    recorder.source = "MLA decode attention at decode buckets 1-256 (DeepSeek-V3's widths, 16 and 128 heads; no MLA engine yet)"
    block_size, row_dim = 16, MLA_LATENT_DIM + MLA_ROPE_DIM
    table_width = -(-MLA_MAX_MODEL_LEN // block_size)
    for dtype in (torch.bfloat16, torch.float16):
        cache = torch.empty(2, block_size, 1, row_dim, dtype=dtype)  # recorded, not run: no row is read
        for num_heads in MLA_HEADS:
            for bucket in DECODE_BUCKETS:
                q = torch.empty(bucket, num_heads, row_dim, dtype=dtype)
                tables = torch.zeros(bucket, table_width, dtype=torch.int64)
                seq_lens = torch.ones(bucket, dtype=torch.int64)
                mla_triton.paged_latent_decode_attention(q, cache, tables, seq_lens, row_dim**-0.5, MLA_LATENT_DIM)


def record(out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tests_path = out_dir / "launches-tests.json"
    tests_path.unlink(missing_ok=True)
    record_kernel_tests(tests_path)
    recorder = LaunchRecorder(launch=False)
    recorder.install()
    split_counts_as_on_the_gpu()
    record_only_kernel_set()
    with tempfile.TemporaryDirectory(prefix="graphrt-aot-") as scratch:
        record_workloads(recorder, Path(scratch))
    launches = json.loads(tests_path.read_text())
    keys = {json.dumps({k: e[k] for k in ("kernel", "args", "options")}, sort_keys=True) for e in launches}
    for key, entry in recorder.launches.items():
        if key not in keys:
            launches.append(entry)
    tests_path.unlink()
    missing = set(kernel_names_in_code()) - {e["kernel"] for e in launches}
    if missing:
        raise SystemExit(f"no workload launched {', '.join(sorted(missing))}: add one to record_workloads()")
    (out_dir / "launches.json").write_text(json.dumps(launches, indent=1) + "\n")
    for source in dict.fromkeys(s for e in launches for s in e["sources"]):
        print(f"  {sum(source in e['sources'] for e in launches):4d} variants launched by {source}")
    print(f"recorded {len(launches)} kernel variants in {time.perf_counter() - started:.0f} s -> {out_dir / 'launches.json'}")
    return launches


# -- 3. compile -------------------------------------------------------------------------------------


def kernel_files() -> list[Path]:
    return sorted((ROOT / "kernels").glob("*_triton.py"))


def kernel_names_in_code() -> list[str]:
    """Every `@triton.jit` function in kernels/*_triton.py that its file launches (`name[grid](...)`),
    read from the source; helpers that kernels call are compiled into them."""
    import ast
    import re

    names = []
    for path in kernel_files():
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                if re.search(rf"\b{node.name}\s*\[", source):
                    names.append(f"{KERNEL_PACKAGE}.{path.stem}:{node.name}")
    return names


class _Stub(types.ModuleType):
    """Any attribute is another stub: enough for a kernel file's top-level imports."""

    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A stub for every module under `prefixes` but `files` ({name: path}), which load from their
    files: a kernel file importing another (its merge kernel, a shared @triton.jit helper) gets it."""

    def __init__(self, prefixes, files):
        self.prefixes = prefixes
        self.files = files

    def find_spec(self, name, path=None, target=None):
        if name in self.files:
            return importlib.util.spec_from_file_location(name, self.files[name])
        if any(name == p or name.startswith(p + ".") for p in self.prefixes):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def load_kernels() -> dict:
    """{"graphrt.kernels.X_triton:name": JITFunction} from kernels/*_triton.py, under the names the
    GPU imports them by (a kernel's callees are hashed by module and name). Without torch, torch and
    graphrt's other modules are stubs while the files load."""
    from triton.runtime.jit import JITFunction

    try:
        import torch  # noqa: F401

        modules = [importlib.import_module(f"{KERNEL_PACKAGE}.{p.stem}") for p in kernel_files()]
    except ImportError:
        before = set(sys.modules)
        files = {f"{KERNEL_PACKAGE}.{path.stem}": path for path in kernel_files()}
        finder = _StubFinder(["torch", "graphrt"], files)
        sys.meta_path.insert(0, finder)
        try:
            modules = [importlib.import_module(name) for name in files]
        finally:
            sys.meta_path.remove(finder)
            for name in set(sys.modules) - before:  # triton must not take the stubs for torch later
                if isinstance(sys.modules[name], _Stub):
                    del sys.modules[name]
    return {
        f"{module.__name__}:{name}": value
        for module in modules
        for name, value in vars(module).items()
        if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__
    }


class _FakeDtype:
    def __init__(self, name: str):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"

    def __hash__(self):
        return hash(("torch", self.name))

    def __eq__(self, other):
        return isinstance(other, _FakeDtype) and other.name == self.name


class _FakeTensor:
    """What the JIT reads of a tensor: its dtype and its address's alignment."""

    def __init__(self, dtype: str, aligned: bool):
        self.dtype = _FakeDtype(dtype)
        self._ptr = 0 if aligned else 8

    def data_ptr(self):
        return self._ptr


def rebuild(described: dict):
    import triton.language as tl

    if "tl_dtype" in described:
        return tl.dtype(described["tl_dtype"])
    if "value" in described:
        return described["value"]
    if "tensor" in described:
        return _FakeTensor(described["tensor"], described["aligned"])
    if "bool" in described:
        return True
    if "int" in described:
        return described["int"]
    if "float" in described:
        return 0.5
    return None


class CompileOnlyDriver:
    """triton's active driver for the JIT's compile path: a target, no GPU."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def triton_key_sha256() -> str:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key
    return hashlib.sha256(triton_key().encode()).hexdigest()


def compile_all(out_dir: Path, cache_dir: Path, allow_other_triton: bool) -> int:
    launches = json.loads((out_dir / "launches.json").read_text())
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    import triton

    if (triton.__version__, sys.version_info[:2]) != (GPU_TRITON, GPU_PYTHON) and not allow_other_triton:
        raise SystemExit(
            f"triton {triton.__version__} on python {sys.version_info[0]}.{sys.version_info[1]}: the GPU image has triton "
            f"{GPU_TRITON} on python {GPU_PYTHON[0]}.{GPU_PYTHON[1]}, and only that wheel's cache keys match there "
            f"(`python3 scripts/triton_aot.py setup` makes {TRITON_VENV.name}; --any-triton only checks that the kernels compile)"
        )
    started = time.perf_counter()
    variants, failures = compile_launches(launches, verbose=True)
    archive = out_dir / ARCHIVE
    with tarfile.open(archive, "w:gz") as tar:
        for entry in sorted(cache_dir.iterdir()):
            tar.add(entry, arcname=entry.name)
    manifest = {
        "triton": triton.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
        "target": {"backend": "cuda", "arch": GPU_ARCH, "warp_size": GPU_WARP_SIZE},
        "triton_key_sha256": triton_key_sha256(),
        "num_variants": len(variants),
        "cache_entries": len(list(cache_dir.iterdir())),
        "variants": variants,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = time.perf_counter() - started
    print(f"compiled {len(variants)} of {len(launches)} variants for sm_{GPU_ARCH} with triton {triton.__version__} in {total:.0f} s; "
          f"{archive} ({archive.stat().st_size / 2**20:.1f} MiB), triton_key sha256 {manifest['triton_key_sha256'][:16]}")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


def merge(out_dir: Path, compiled_here: Path) -> int:
    """The entries gpu_check.sh's triton-compiled-here.tar.gz brought back (what the GPU's JIT still
    compiled, beside the carried ones) join the archive, so the next check carries them too. They are
    keyed by the GPU's own triton, so they can only be hits there; an entry already carried is kept."""
    archive = out_dir / ARCHIVE
    for needed in (archive, out_dir / "manifest.json", compiled_here):
        if not needed.is_file():
            raise SystemExit(f"merge: {needed} does not exist (`scripts/triton_aot.py all` makes the archive; the GPU check brings back triton-compiled-here.tar.gz)")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
        before = {entry.name for entry in folder.iterdir()}
        with tarfile.open(compiled_here) as tar:
            new = [m for m in tar.getmembers() if m.name.removeprefix("./").split("/")[0] not in before]
            tar.extractall(folder, members=new, filter="data")
        added = sorted({entry.name for entry in folder.iterdir()} - before)
        with tarfile.open(archive, "w:gz") as tar:
            for entry in sorted(folder.iterdir()):
                tar.add(entry, arcname=entry.name)
    manifest_path = out_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["cache_entries"] = len(before) + len(added)
    manifest.setdefault("merged", []).append({"from": str(compiled_here), "entries": len(added)})
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(added)} entries from {compiled_here} joined {archive} ({len(before) + len(added)} in all)")
    return 0


def compile_launches(launches: list[dict], verbose: bool = False) -> tuple[list[dict], list[str]]:
    """Each launch compiled for sm_90 into TRITON_CACHE_DIR: (variants with their cache hash, failures)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    kernels = load_kernels()
    previous = driver._active  # set_active has no undo that leaves no driver: a machine without a GPU has none
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", GPU_ARCH, GPU_WARP_SIZE)))
    variants, failures = [], []
    for number, launch in enumerate(launches, start=1):
        fn = kernels.get(launch["kernel"])
        label = f"{launch['kernel'].split(':')[1]}({', '.join(f'{k}={v}' for k, v in constants_of(launch).items())})"
        if fn is None:
            failures.append(f"{launch['kernel']}: no such kernel in kernels/ (launches.json is stale: run `record`)")
            continue
        try:
            args = [rebuild(launch["args"][name]) for name in fn.arg_names]
            start = time.perf_counter()
            kernel = fn.run(*args, grid=(1,), warmup=True, **launch["options"])
            seconds = time.perf_counter() - start
        except Exception as exc:  # every variant is tried; the summary names each failure
            failures.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        meta = kernel.metadata
        variants.append({**launch, "hash": meta.hash, "shared_bytes": meta.shared, "num_warps": meta.num_warps, "compile_s": round(seconds, 2)})
        if verbose:
            print(f"  {number:3d} {label:<90} {seconds:5.2f} s  smem {meta.shared:6d}  {meta.hash[:12]}")
    driver._active = previous
    return variants, failures


def constants_of(launch: dict) -> dict:
    """The constexprs and dtypes of a launch, for one line of the compile list."""
    shown = {}
    for name, described in launch["args"].items():
        if "value" in described:
            shown[name] = described["value"]
        elif "tl_dtype" in described:
            shown[name] = described["tl_dtype"]
        elif "tensor" in described and "dtype" not in shown:
            shown["dtype"] = described["tensor"]
    return shown


# -- 2. setup and the whole ---------------------------------------------------------------------------


def find_python312() -> str:
    candidates = [os.environ.get("PYTHON312"), shutil.which("python3.12")]
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(map(str, Path(root).glob("versions/3.12*/bin/python3.12")), reverse=True)
    except FileNotFoundError:
        pass
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 12))"], capture_output=True).returncode == 0:
            return candidate
    raise SystemExit("no Python 3.12 found (the GPU image's): set PYTHON312 to one")


def setup() -> None:
    python = TRITON_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([find_python312(), "-m", "venv", str(TRITON_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"triton=={GPU_TRITON}"], check=True)
    print(f"{TRITON_VENV.name}: {subprocess.run([str(python), '-c', 'import sys, triton; print(sys.version.split()[0], triton.__version__)'], capture_output=True, text=True).stdout.strip()}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["record", "setup", "compile", "all", "merge"])
    parser.add_argument("archive", nargs="?", type=Path, help="merge: the triton-compiled-here.tar.gz a GPU check brought back")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="launches.json, the archive and its manifest [default: .triton-aot]")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "graphrt-triton-aot-cache",
                        help="the TRITON_CACHE_DIR compiled into, then archived")
    parser.add_argument("--any-triton", action="store_true", help="compile with whatever triton is installed (checks, but will not match the GPU)")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.out)
        return 0
    if args.command == "setup":
        setup()
        return 0
    if args.command == "compile":
        return compile_all(args.out, args.cache_dir, args.any_triton)
    if args.command == "merge":
        if args.archive is None:
            parser.error("merge needs the archive: scripts/triton_aot.py merge PATH/triton-compiled-here.tar.gz")
        return merge(args.out, args.archive)
    venv_python = ROOT / ".venv" / "bin" / "python"
    script = str(Path(__file__).resolve())
    subprocess.run([str(venv_python), script, "record", "--out", str(args.out)], check=True)
    setup()
    return subprocess.run([str(TRITON_VENV / "bin" / "python"), script, "compile", "--out", str(args.out), "--cache-dir", str(args.cache_dir)]).returncode


if __name__ == "__main__":
    sys.exit(main())
