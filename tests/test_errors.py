"""Every mistake a user can make with a model or a request gets a message that says what to do."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from graphrt import LLM, ModelLoadError, RequestError, SamplingParams
from graphrt.cli import main


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=tmp_path / "nope")


def test_a_model_file_instead_of_its_folder_names_the_folder(tiny_model_factory):
    folder = tiny_model_factory()
    with pytest.raises(ModelLoadError, match=f"is a file; pass the Hugging Face style folder that holds it \\(--model {folder}\\)"):
        LLM(model=folder / "config.json")


def test_empty_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(model=tmp_path)


def test_unknown_architecture_names_it_and_the_supported_list(tiny_model_factory, tmp_path):
    model_dir = shutil.copytree(tiny_model_factory(), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(model=model_dir)


def test_truncated_safetensors_names_the_file(tiny_model_factory, tmp_path):
    model_dir = shutil.copytree(tiny_model_factory(), tmp_path / "m")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*truncated"):
        LLM(model=model_dir)


def test_missing_tensor_is_reported(tiny_model_factory, tmp_path):
    model_dir = shutil.copytree(tiny_model_factory(), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] += 1  # the weights hold one layer fewer than the config says
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"lack 9 tensors.*model\.layers\.4\."):
        LLM(model=model_dir)


def test_a_shard_missing_from_the_folder_is_named(tiny_model_factory, tmp_path):
    """A download cut short (DeepSeek-V3 comes in 163 shards): the index names the file that is not there."""
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(tiny_model_factory(), tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, held in shards.items():
        save_file({name: tensors[name] for name in held}, model_dir / shard)
    weight_map = {name: shard for shard, held in shards.items() for name in held}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    LLM(model=model_dir, max_batch=1)  # whole, it loads
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    message = (f"{model_dir} lacks 1 shard that model.safetensors.index.json names (model-00002-of-00002.safetensors), "
               f"holding {len(shards['model-00002-of-00002.safetensors'])} tensors the config needs; the download is incomplete")
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        LLM(model=model_dir)


def test_a_cache_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """A read-only home or image: it was a 51-line traceback ending in OSError. (As root, which CI
    runs as, permissions do not stop a write; a file where the cache's folder should be does.)"""
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "not-a-folder" / "graphrt"))
    result = CliRunner().invoke(main, ["generate", "--prompt", "hi"])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "Traceback" not in result.output, result.output
    assert f"cannot write graphrt's cache in {tmp_path / 'not-a-folder' / 'graphrt'} to convert the default model" in result.output
    assert "set GRAPHRT_CACHE to a writable folder" in result.output


def test_pp_larger_than_layers(tiny_model_factory):
    with pytest.raises(Exception, match=r"--pp 5 is larger than the model's 4 layers"):
        LLM(model=tiny_model_factory(), pp=5)


def test_prompt_longer_than_context(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), kv_cache_tokens=1024)
    with pytest.raises(RequestError, match=r"prompt 1: This model's maximum context length is 256 tokens, and the prompt is 300 tokens"):
        llm.generate([[1, 2, 3], [7] * 300], SamplingParams(max_tokens=4))
    # Nothing was left behind: the first, valid prompt released its blocks, and the engine still works.
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks - 1
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_prompt_plus_max_tokens_beyond_context(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), kv_cache_tokens=1024)
    with pytest.raises(RequestError, match=r"lower max_tokens to 246 or less"):
        llm.generate([1] * 10, SamplingParams(max_tokens=250))


def test_kv_cache_too_small_for_the_request(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), kv_cache_tokens=32)
    with pytest.raises(RequestError, match=r"needs 50 tokens of KV cache but the whole cache holds 32"):
        llm.generate([1] * 10, SamplingParams(max_tokens=40))


def test_token_ids_outside_vocabulary(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), kv_cache_tokens=64)
    with pytest.raises(RequestError, match=r"token id 97 is outside the vocabulary \[0, 97\)"):
        llm.generate([1, 97])


def test_text_prompt_without_tokenizer(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), kv_cache_tokens=64)
    with pytest.raises(RequestError, match="no tokenizer; pass prompts as lists of token ids"):
        llm.generate("hello")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), r"temperature must be a finite number >= 0 \(0 is greedy\), got -1.0"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        (dict(top_k=-2), r"top_k must be an integer in \[0, 9223372036854775807\] \(0 or -1 disables it\), got -2"),
        (dict(max_tokens=0), "max_tokens must be a positive integer"),
        (dict(stop=[""]), "stop must be a string or a list of non-empty strings"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pp=0), "pp must be a positive integer"),
        (dict(depth=-1), "depth must be a non-negative integer"),
        (dict(async_scheduling="yes"), "async_scheduling must be True or False"),
        (dict(block_size=12), "block_size must be a power of two"),
        (dict(buckets=[0, 4]), "buckets must be positive batch sizes"),
        (dict(kernels="cutlass"), "kernels must be auto, torch or triton"),
    ],
)
def test_bad_engine_options(kwargs, message):
    from graphrt.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "model folder /nonexistent/model does not exist"),
        (["--pp", "9"], "--pp 9 is larger than the model's 4 layers"),
        (["--dtype", "int8"], "dtype 'int8' is not supported; use auto (the default) or one of"),
        (["--devices", "cpu,cpu"], "--devices names 2 devices for 1 stages"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(tiny_model_factory, args, message):
    argv = ["generate", "--prompt", "hi", "--model", str(tiny_model_factory()), *args]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1


def test_a_sliding_window_caps_the_context(tiny_model_factory, tmp_path):
    model_dir = shutil.copytree(tiny_model_factory("mistral"), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 64  # attention is not windowed, so only 64 tokens are exact
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(model=model_dir, kv_cache_tokens=256)
    assert llm.engine.max_model_len == 64
    with pytest.raises(RequestError, match="maximum context length is 64 tokens, and the prompt is 70 tokens"):
        llm.generate([1] * 70)


@pytest.mark.parametrize(
    "cuda, gpus, config, message",
    [
        (None, 0, dict(devices=["cuda:0"]), "--devices names cuda:0, but this torch is a CPU build; run on the CPU"),
        ("13.0", 0, dict(devices=["cuda:0"]), "--devices names cuda:0, but CUDA sees no GPU here"),
        ("13.0", 2, dict(pp=2, devices=["cuda:0", "cuda:3"]), "--devices names cuda:3, but this machine shows 2 GPUs (cuda:0 to cuda:1)"),
        ("13.0", 2, dict(pp=2, devices=["cuda:2", "cuda:0"], procs=True), "--devices names cuda:2, but this machine shows 2 GPUs"),
        ("13.0", 2, dict(pp=2, devices=["cuda:1", "cuda:0"]), None),
        # With stage processes only stage 0 is here: the others may be on another host's GPUs.
        ("13.0", 2, dict(pp=2, devices=["cuda:1", "cuda:5"], procs=True), None),
        (None, 0, dict(pp=2, devices=["cpu", "cpu"]), None),
    ],
)
def test_devices_this_process_runs_on_must_exist_here(monkeypatch, cuda, gpus, config, message):
    """Before any weight loads, and without a stack trace of torch's lazy CUDA set-up."""
    import torch

    from graphrt.config import EngineConfig

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    engine_config = EngineConfig(**config)
    if message is None:
        engine_config.check_devices_here()
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        engine_config.check_devices_here()


def test_a_gpu_named_with_a_cpu_build_of_torch_is_one_line(tiny_model_factory):
    if torch_version_cuda() is not None:
        pytest.skip("this torch is a CUDA build")
    result = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--model", str(tiny_model_factory()), "--devices", "cuda:0"])
    assert result.exit_code == 1
    assert result.output == "error: --devices names cuda:0, but this torch is a CPU build; run on the CPU by leaving out --devices, or give cpu\n"


def torch_version_cuda() -> str | None:
    import torch

    return torch.version.cuda
