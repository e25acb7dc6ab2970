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
        f"{'stage':>5} {'bucket':>6} {'mode':>5} {'ms':>8} {'MiB':>7} {'kernels':>7} {'memcpy':>6} {'max err':>9}",
    ]
    for g in manifest["graphs"]:
        nodes = g.get("nodes") or {}
        pool = g.get("pool_bytes")
        lines.append(
            f"{g['stage']:>5} {g['bucket']:>6} {g['mode']:>5} {g['capture_ms']:>8.1f} "
            f"{_cell(pool / 2**20 if pool is not None else None, '{:.1f}'):>7} "
            f"{_cell(nodes.get('kernel')):>7} {_cell(nodes.get('memcpy')):>6} {_cell(g.get('max_abs_error'), '{:.2g}'):>9}"
        )
    notes = sorted({g["note"] for g in manifest["graphs"] if g.get("note")})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
