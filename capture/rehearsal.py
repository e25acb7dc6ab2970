"""A rehearsal of CUDA graph capture that also runs on the CPU: refuse what a graph cannot hold.

A decode forward that reads a tensor on the host or makes a shape from tensor values fails CUDA
capture with an error naming neither op nor stage ("operation not permitted when stream is
capturing"); one that swaps a buffer between steps records fine, then replays stale data.
`rehearse_stage` runs a (stage, bucket) forward twice over its static buffers, as capture's warm-ups
do (writing only where they point: the scratch block, for fresh ones), watches every aten op under
a `TorchDispatchMode`, and names the stage, bucket, op, calling line and fix for:

- host syncs: `.item()`, `bool()` of a tensor, `torch.equal`, `allclose`;
- data-dependent shapes: nonzero, `where(cond)`, masked_select, bool-mask indexing, unique,
  bincount, repeat_interleave with tensor repeats and no `output_size`;
- copies between the stage's device and another (on a CUDA stage: to or from the host);
- tensors made on another device, but for 0-dim CPU ones on a CUDA stage (CUDA ops return such
  metadata, e.g. attention's philox seed, and capture tolerates it);
- a static input, KV cache tensor, weight or buffer replaced or moved; an output the forward did
  not allocate that is not the same buffer in both runs; writes into a tensor none of these owns.

Out of sight: on a CPU stage the host is the device, so `.cpu()` is a no-op and `.tolist()` /
`.numpy()` copy nothing (on a CUDA stage `.cpu()` is a copy, and refused). Python branches on host
values, `torch.cuda.synchronize`, and syncs inside a C++ kernel or a composite op (inference mode
dispatches those whole) are not seen on any device.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphrt.capture.graphs import StaticInputs
from graphrt.errors import GraphrtError
from graphrt.model.kv_cache import StageKVCache
from graphrt.model.llama import Stage

aten = torch.ops.aten

# Matched at both levels the mode sees: composite ops (`item`, `to`) in inference mode, where the
# stage's forward runs, and their decompositions (`_local_scalar_dense`, `_to_copy`) outside it.
# Each with the Python that reaches it: on CUDA, `.item()` arrives as `_local_scalar_dense` alone.
HOST_SYNCS = {
    aten._local_scalar_dense: ".item(), int(), float() or bool() of a tensor",
    aten.item: ".item()",
    aten.is_nonzero: "bool() of a tensor (an if on it)",
    aten.equal: "torch.equal",
    aten.allclose: "torch.allclose",
}
DYNAMIC_SHAPES = {
    aten.nonzero, aten.nonzero_numpy, aten.argwhere, aten.masked_select, aten.bincount,
    aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive,
}  # fmt: skip
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
COPIES = {aten.to, aten._to_copy, aten.copy, aten.copy_, aten._copy_from, aten._copy_from_and_resize}

KEEP_ON_DEVICE = "keep the value on the device (compute with tensors, torch.where instead of an if)"
GIVE_THE_SIZE = "give the size explicitly (torch.where(mask, a, b), masked_fill, nonzero_static, output_size=)"
STAY_ON_DEVICE = "keep it on the stage's device (inputs reach a graph through its static buffers)"


class RehearsalError(GraphrtError):
    """A (stage, bucket) decode forward does something a CUDA graph cannot record or replay."""


def rehearse_stage(stage: Stage, cache: StageKVCache, inputs: StaticInputs) -> list[float]:
    """Run the stage's decode forward twice over `inputs`; raise RehearsalError at the first problem.
    Returns each run's seconds, to the device's end: the first pays for first calls (Triton's compile
    or cache load, cuBLAS set-up) where nothing ran them before; the second is the watch's own cost."""
    where = f"stage {stage.index}, bucket {inputs.x.shape[0]}"
    before = _addresses(stage, cache, inputs)
    owned = {_storage(tensor) for tensor, _ in before.values()} - {0}
    outputs, seconds = [], []
    for _ in range(2):
        started = time.perf_counter()
        with _Watch(where, stage.device, owned) as watch:
            out = stage(inputs.x, inputs.meta, cache)
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)
        seconds.append(time.perf_counter() - started)
        after = _addresses(stage, cache, inputs)
        for name, (tensor, address) in before.items():
            if name not in after or after[name][0] is not tensor or after[name][1] != address:
                raise RehearsalError(
                    f"{where}: the forward replaced or moved {name}; a graph keeps using the buffer it "
                    "saw at capture, so update it in place (copy_) instead"
                )
        outputs.append((_storage(out) in watch.fresh, out.data_ptr(), tuple(out.shape)))
    (fresh_1, address_1, shape_1), (fresh_2, address_2, shape_2) = outputs
    if shape_1 != shape_2 or (not (fresh_1 and fresh_2) and address_1 != address_2):
        raise RehearsalError(
            f"{where}: the output buffer changed between two replays ({shape_1} at {address_1:#x}, then "
            f"{shape_2} at {address_2:#x}); a graph always writes its output where capture saw it, so "
            "return a tensor the forward computes, or the same buffer every time"
        )
    return seconds


class _Watch(TorchDispatchMode):
    """Checks each aten op of one forward run; `fresh` collects the storages the run allocated."""

    def __init__(self, where: str, device: torch.device, owned: set[int]):
        super().__init__()
        self.where, self.device, self.owned = where, device, owned
        self.fresh: set[int] = set()
        self.written_args: dict = {}  # op -> (position, name, keyword-only) of each argument it writes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.check_op(func, args, kwargs)
        inputs = {_storage(t) for t in _tensors((*args, *kwargs.values()))}
        out = func(*args, **kwargs)
        self.check_result(func, args, kwargs, out, inputs)
        return out

    def refuse(self, func, problem: str, advice: str) -> None:
        raise RehearsalError(f"{self.where}: {func}{_caller()} {problem}, which a CUDA graph cannot record; {advice}")

    def check_op(self, func, args, kwargs) -> None:
        packet = func.overloadpacket
        # repeat_interleave with a tensor of repeats sums them on the host unless given output_size
        summed_repeats = (
            packet is aten.repeat_interleave and func._overloadname != "self_int" and kwargs.get("output_size") is None
        )
        if packet in HOST_SYNCS:
            self.refuse(func, f"reads a tensor's value on the host (as {HOST_SYNCS[packet]} does)", KEEP_ON_DEVICE)
        if packet in DYNAMIC_SHAPES or func is aten.where.default or summed_repeats:
            self.refuse(func, "makes an output whose size depends on tensor values", GIVE_THE_SIZE)
        if packet in INDEXING and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self.refuse(func, "indexes with a boolean mask, so its size depends on the mask", GIVE_THE_SIZE)

    def check_result(self, func, args, kwargs, out, inputs: set[int]) -> None:
        if func.overloadpacket in COPIES:
            source, target = _copy_devices(func.overloadpacket, args, out)
            if not _same_device(source, target):
                self.refuse(func, f"copies a tensor from {source} to {target}", STAY_ON_DEVICE)
        for tensor in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
            host_scalar = tensor.dim() == 0 and tensor.device.type == "cpu"
            if not _same_device(tensor.device, self.device) and not host_scalar:
                on = f"on {tensor.device}, not on the stage's device {self.device}"
                self.refuse(func, f"makes a tensor {on}", "create it there (device=x.device)")
            if _storage(tensor) not in inputs:
                self.fresh.add(_storage(tensor))
        for tensor in self.written(func, args, kwargs):
            storage = _storage(tensor)
            if storage and storage not in self.fresh and storage not in self.owned:
                problem = "writes into a tensor that the forward did not allocate and the stage does not own"
                self.refuse(func, problem, "allocate it in the forward, or make it a buffer of the stage")

    def written(self, func, args, kwargs) -> list[torch.Tensor]:
        if func not in self.written_args:
            schema = enumerate(func._schema.arguments)
            self.written_args[func] = [(i, a.name, a.kwarg_only) for i, a in schema if a.alias_info and a.alias_info.is_write]
        return _tensors([kwargs.get(name) if kw or i >= len(args) else args[i] for i, name, kw in self.written_args[func]])


def _addresses(stage: Stage, cache: StageKVCache, inputs: StaticInputs) -> dict[str, tuple[torch.Tensor, int]]:
    """Every buffer a graph of this stage uses outside its pool, with its address."""
    named = {"the static input x": inputs.x, "the KV cache's k": cache.k, "the KV cache's v": cache.v}
    for field in dataclasses.fields(inputs.meta):
        if isinstance(value := getattr(inputs.meta, field.name), torch.Tensor):
            named[f"the static {field.name}"] = value
    for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
        named[f"the stage's {name}"] = tensor
    return {name: (tensor, tensor.data_ptr() if _storage(tensor) else id(tensor)) for name, tensor in named.items()}


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results (aten nests them at most one list deep)."""
    flat = [v for value in values for v in (value if isinstance(value, (tuple, list)) else (value,))]
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> int:
    """Address of the tensor's storage; 0 where there is none to compare (mkldnn, meta)."""
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return 0
    return tensor.untyped_storage().data_ptr()


def _copy_devices(packet, args, out) -> tuple[torch.device, torch.device]:
    if packet in (aten.to, aten._to_copy):
        return args[0].device, out.device
    if packet in (aten._copy_from, aten._copy_from_and_resize):
        return args[0].device, args[1].device
    return args[1].device, args[0].device  # copy(self, src), copy_(self, src)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _caller() -> str:
    """' at folder/file.py:line' of the innermost frame outside torch, triton and this file."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path != Path(__file__) and not {"torch", "triton"} & set(path.parts):
            return f" at {path.parent.name}/{path.name}:{frame.lineno}"
    return ""
