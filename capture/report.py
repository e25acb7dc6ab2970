"""The manifest as a table for people (`graphrt capture` and `graphrt capture --inspect`)."""

from __future__ import annotations


def _cell(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def manifest_table(manifest: dict) -> str:
    stages = ", ".join(f"{s['device']} layers {s['layers'][0]}-{s['layers'][1] - 1}" for s in manifest["stages"])
    lines = [
        f"model {manifest.get('model_dir', '?')} ({manifest['architecture']}, {manifest['dtype']}), "
        f"fingerprint {manifest['model_fingerprint'][:12]}",
        f"pp={manifest['pp']}: {stages}",
        f"backend {manifest['backend']}, kernels {manifest['kernels']}, buckets {manifest['buckets']}, "
        f"KV cache {manifest.get('kv_cache_blocks', '?')} blocks of {manifest['block_size']} tokens",
        f"torch {manifest['torch']}, triton {manifest['triton']}, CUDA {manifest['cuda']}, driver {manifest['driver']}; "
        f"created {manifest.get('created', '?')}",
        "",
        f"{'stage':>5} {'bucket':>6} {'mode':>5} {'warm ms':>8} {'capt ms':>8} {'MiB':>7} {'kernels':>7} {'memcpy':>6} {'max err':>9}",
    ]
    for g in manifest["graphs"]:
        nodes = g.get("nodes") or {}
        pool = g.get("pool_bytes")
        lines.append(
            f"{g['stage']:>5} {g['bucket']:>6} {g['mode']:>5} {_cell(g.get('warmup_ms'), '{:.1f}'):>8} {g['capture_ms']:>8.1f} "
            f"{_cell(pool / 2**20 if pool is not None else None, '{:.1f}'):>7} "
            f"{_cell(nodes.get('kernel')):>7} {_cell(nodes.get('memcpy')):>6} {_cell(g.get('max_abs_error'), '{:.2g}'):>9}"
        )
    lines.append(time_line(manifest["graphs"]))
    notes = sorted({g["note"] for g in manifest["graphs"] if g.get("note")})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


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
