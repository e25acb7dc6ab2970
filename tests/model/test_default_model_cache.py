"""The default model's conversion into graphrt's cache, as processes starting at once meet it."""

from __future__ import annotations

import threading
import time

from graphrt.model import default_model
from graphrt.model.default_model import COMPLETE_MARKER, DEFAULT_MODEL_NAME, default_model_dir


def test_starts_at_once_convert_the_default_model_once(tmp_path, monkeypatch):
    """Two test workers (or a server and a script) on a fresh machine: the first converts, the
    second waits for it and reads its folder. Before the lock both converted, and the second's
    rename over the first's finished folder failed (directory not empty)."""
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path))
    conversions = []

    def convert(gguf_path, out_dir):
        conversions.append(threading.current_thread().name)
        time.sleep(0.3)  # long enough for the other to arrive while this one converts
        out_dir.mkdir(parents=True)
        (out_dir / COMPLETE_MARKER).write_text("converted\n")
        return out_dir

    monkeypatch.setattr(default_model, "import_gguf", convert)
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: tmp_path / "model.gguf")
    found = {}
    threads = [threading.Thread(target=lambda: found.update({threading.current_thread().name: default_model_dir()}),
                                name=f"start-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    expected = tmp_path / "models" / DEFAULT_MODEL_NAME
    assert len(conversions) == 1, conversions
    assert found == {"start-0": expected, "start-1": expected}
    assert default_model_dir() == expected and len(conversions) == 1  # later starts read it without the lock's wait
