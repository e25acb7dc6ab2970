"""The manifest as a table for people (`graphrt capture` and `graphrt capture --inspect`)."""

from __future__ import annotations


def _cell(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def layer_span(start: int, stop: int) -> str:
    """`layer 3` for (3, 4), `layers 0-2` for (0, 3)."""
    return f"layer {start}" if stop - start == 1 else f"layers {start}-{stop - 1}"


def manifest_table(manifest: dict) -> str:
    stages = ", ".join(f"{s['device']} {layer_span(*s['layers'])}" for s in manifest["stages"])
    lines = [
        f"model {manifest.get('model_dir', '?')} ({manifest['architecture']}, {manifest['dtype']}), "
        f"fingerprint {manifest['model_fingerprint'][:12]}",
        f"pp={manifest['pp']}: {stages}",
        f"backend {manifest['backend']}, kernels {manifest['kernels']}, buckets {manifest['buckets']}, "
        f"KV cache {manifest.get('kv_cache_blocks', '?')} blocks of {manifest['block_size']} tokens",
        f"torch {manifest['torch']}, triton {manifest['triton']}, CUDA {manifest['cuda']}, driver {manifest['driver']}; "
        f"created {manifest.get('created', '?')}",
        "",
    ]
    if all(stage["device"] == "cpu" for stage in manifest["stages"]):
        return "\n".join(lines + cpu_lines(manifest))
    lines.append(f"{'stage':>5} {'bucket':>6} {'mode':>5} {'warm ms':>8} {'capt ms':>8} {'MiB':>7} {'kernels':>7} {'memcpy':>6} {'max err':>9} {'allowed':>9}")
    for g in manifest["graphs"]:
        nodes = g.get("nodes") or {}
        pool = g.get("pool_bytes")
        lines.append(
            f"{g['stage']:>5} {g['bucket']:>6} {g['mode']:>5} {_cell(g.get('warmup_ms'), '{:.1f}'):>8} {g['capture_ms']:>8.1f} "
            f"{_cell(pool / 2**20 if pool is not None else None, '{:.1f}'):>7} "
            f"{_cell(nodes.get('kernel')):>7} {_cell(nodes.get('memcpy')):>6} {_cell(g.get('max_abs_error'), '{:.2g}'):>9} "
            f"{_cell(g.get('max_abs_error_allowed'), '{:.2g}'):>9}"
        )
    lines.append(time_line(manifest["graphs"]))
    notes = sorted({g["note"] for g in manifest["graphs"] if g.get("note")})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def cpu_lines(manifest: dict) -> list[str]:
    """What a capture on CPUs did: no graph is recorded there (each bucket runs the stage's forward
    over its static buffers), so its time goes to measuring each weight shape's matmul path and
    each op's kernel, and to checking the largest bucket against the plain forward."""
    lines = []
    for g in manifest["graphs"]:
        if g.get("max_abs_error") is not None:
            allowed = g.get("max_abs_error_allowed")
            lines.append(
                f"stage {g['stage']}, bucket {g['bucket']}: replay over the static buffers (with a padding row) against the "
                f"stage's plain forward, max difference {g['max_abs_error']:.2g}" + (f" (allowed {allowed:.2g})" if allowed is not None else "")
            )
    lines.append(f"buckets {', '.join(map(str, manifest['buckets']))} run eagerly over static buffers (no CUDA graphs on a CPU); "
                 "the largest is checked for each stage")
    for index, plan in enumerate(manifest.get("matmuls") or []):
        paths = ", ".join(f"{choice['name']} {choice['path']}" for choice in plan.get("choices", []))
        rows = " and ".join(map(str, plan.get("rows", [])))
        lines.append(f"stage {index} matmuls, fastest at {rows} rows (measured in {plan.get('measure_s', 0):.1f} s): {paths}")
    cpu_kernels = manifest.get("cpu_kernels") or {}
    if cpu_kernels.get("ops"):
        ops = ", ".join(f"{op} {path}" for op, path in cpu_kernels["ops"].items())
        lines.append(f"ops: {ops}; greedy argmax {cpu_kernels.get('greedy_argmax', '?')}")
    lines.append("a start with this cache takes these choices instead of measuring them")
    return lines


def time_line(graphs: list[dict]) -> str:
    """Where capture's time went: warm-up (first calls compile and autotune the Triton kernels, which a
    start with the cache's TRITON_CACHE_DIR skips) apart from recording the graphs (every start)."""
    capture_s = sum(g["capture_ms"] for g in graphs) / 1000
    if any("warmup_ms" not in g for g in graphs):  # a cache written before the two were apart
        return f"capture {capture_s:.2f} s, warm-up and Triton compile included (this cache does not tell them apart)"
    warmup_s = sum(g["warmup_ms"] for g in graphs) / 1000
    if any("first_calls_ms" not in g for g in graphs):  # a cache written before the rehearsal was timed
        return f"warm-up {warmup_s:.2f} s (Triton compile and autotuning on first calls, rehearsal), recording {capture_s:.2f} s"
    first_calls_s = sum(g["first_calls_ms"] for g in graphs) / 1000
    rehearsal_s = sum(g["rehearsal_ms"] for g in graphs) / 1000
    slowest = max(graphs, key=lambda g: g["first_calls_ms"])
    return (
        f"warm-up {warmup_s:.2f} s: first calls {first_calls_s:.2f} s (Triton compiles or cache loads, cuBLAS set-up; "
        f"most at stage {slowest['stage']} bucket {slowest['bucket']}, {slowest['first_calls_ms'] / 1000:.2f} s), "
        f"rehearsal checks {rehearsal_s - first_calls_s:.2f} s, warm-up runs {warmup_s - rehearsal_s:.2f} s; "
        f"recording {capture_s:.2f} s"
    )
