"""What cuda-python can tell about a recorded graph and the machine (None, with a reason, elsewhere)."""

from __future__ import annotations

import torch


def graph_node_counts(graph: torch.cuda.CUDAGraph) -> tuple[dict[str, int] | None, str | None]:
    """Kernel / memcpy / memset / other node counts of a captured graph, or (None, why not).

    The counts are for the manifest only, so nothing here may fail a capture: any error becomes
    the reason recorded instead of the counts."""
    if not hasattr(graph, "raw_cuda_graph"):
        return None, f"torch {torch.__version__} has no CUDAGraph.raw_cuda_graph()"
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None, "cuda-python is not installed"
    try:
        return _count_nodes(cudart, graph.raw_cuda_graph()), None
    except Exception as exc:  # noqa: BLE001 - reported in the manifest instead
        return None, f"could not count graph nodes: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _count_nodes(cudart, raw_graph: int) -> dict[str, int]:
    handle = cudart.cudaGraph_t(init_value=raw_graph)
    err, _, num_nodes = cudart.cudaGraphGetNodes(handle, 0)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphGetNodes failed: {err.name}")
    err, nodes, _ = cudart.cudaGraphGetNodes(handle, num_nodes)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphGetNodes failed: {err.name}")
    counts = {"kernel": 0, "memcpy": 0, "memset": 0, "other": 0}
    kinds = {
        cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel: "kernel",
        cudart.cudaGraphNodeType.cudaGraphNodeTypeMemcpy: "memcpy",
        cudart.cudaGraphNodeType.cudaGraphNodeTypeMemset: "memset",
    }
    for node in nodes:
        err, kind = cudart.cudaGraphNodeGetType(node)
        counts[kinds.get(kind, "other") if err == cudart.cudaError_t.cudaSuccess else "other"] += 1
    return counts


def pool_segment_bytes(pool) -> int:
    """Bytes the caching allocator holds for one graph memory pool (nothing else's memory counted)."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool))


def driver_version() -> str | None:
    """The CUDA version the driver supports, e.g. '12.8', or None without a driver."""
    if not torch.cuda.is_available():
        return None
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    err, version = cudart.cudaDriverGetVersion()
    if err != cudart.cudaError_t.cudaSuccess or not version:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"
