"""A server's memory and CPU time summed over its process tree: `graphrt serve` is a front process
and an engine process (and a process per stage with --procs), so the front's own figure is only a
part. Shared by peer_vllm.py and soak.py; a helper module, not a benchmark (it needs psutil).
"""

from __future__ import annotations


def _each(pid: int, read) -> list:
    """read(process) for a process and each of its descendants; a descendant that exits while it
    is read is left out (the process itself gone raises psutil.NoSuchProcess)."""
    import psutil

    root = psutil.Process(pid)
    values = [read(root)]
    for child in root.children(recursive=True):
        try:
            values.append(read(child))
        except psutil.NoSuchProcess:
            pass
    return values


def tree_memory(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MiB summed over a process and its descendants; PSS splits shared pages."""
    infos = _each(pid, lambda proc: proc.memory_full_info())
    return sum(i.rss for i in infos) / 2**20, sum(i.pss for i in infos) / 2**20


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process and its descendants."""
    return sum(_each(pid, lambda proc: sum(proc.cpu_times()[:2])))
