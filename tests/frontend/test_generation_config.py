"""The model's generation_config.json sampling defaults, applied where a request leaves a key out,
as vLLM's `--generation-config auto` does; `vllm` keeps the API's."""

from __future__ import annotations

import json
import logging

import pytest

from graphrt import LLM, SamplingParams
from graphrt.frontend.generation_config import describe, resolve, sampling_defaults
from graphrt.server.chat_protocol import ChatCompletionRequest
from graphrt.server.protocol import CompletionRequest

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def write(folder, config) -> None:
    (folder / "generation_config.json").write_text(json.dumps(config))


def test_the_sampling_keys_are_read_and_the_rest_ignored(tmp_path):
    write(tmp_path, QWEN3)
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert describe(sampling_defaults(tmp_path)).startswith("sampling defaults from the model's generation_config.json: temperature=0.6, top_p=0.95, top_k=20")
    assert describe({"top_k": 5}, str(tmp_path)).startswith(f"sampling defaults from {tmp_path / 'generation_config.json'}: top_k=5")
    assert sampling_defaults(tmp_path / "nowhere") == {}


def test_transformers_own_defaults_count_as_unset_as_vllm_reads_them(tmp_path):
    write(tmp_path, {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "min_p": 0.1})
    assert sampling_defaults(tmp_path) == {"min_p": 0.1}
    write(tmp_path, {"top_k": 20.0, "temperature": True})
    assert sampling_defaults(tmp_path) == {"top_k": 20}


def test_a_value_no_request_could_give_is_left_out_saying_so(tmp_path, caplog):
    write(tmp_path, {"temperature": -1, "top_p": 0.9, "repetition_penalty": "high", "min_p": 0.05})
    with caplog.at_level(logging.WARNING):
        assert sampling_defaults(tmp_path) == {"top_p": 0.9, "min_p": 0.05}
    assert "temperature=-1 is left out: temperature must be a finite number >= 0" in caplog.text
    assert "repetition_penalty='high' is left out" in caplog.text
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}


def test_resolve_reads_the_model_folder_another_folder_or_nothing(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    write(model, QWEN3)
    write(other, {"temperature": 0.3})
    assert resolve("auto", model)["temperature"] == 0.6
    assert resolve(str(other), model) == {"temperature": 0.3}
    assert resolve("vllm", model) == {}
    with pytest.raises(ValueError, match="--generation-config .*: no generation_config.json there; give auto, vllm or a folder"):
        resolve(str(tmp_path), model)


def test_a_request_takes_the_defaults_only_for_what_it_leaves_out_or_sends_as_null():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    [left_out] = CompletionRequest.model_validate({"prompt": "hi"}).sampling_params(defaults=defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    given = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_k": 0, "repetition_penalty": None}
    )
    [params] = given.sampling_params(defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 0.95, 0, 1.05)
    [greedy] = CompletionRequest.model_validate({"prompt": "hi", "top_p": 0}).sampling_params(defaults=defaults)
    assert greedy.temperature == 0.0  # top_p 0 asks for greedy, whatever the model's temperature
    [plain] = CompletionRequest.model_validate({"prompt": "hi"}).sampling_params()
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_llm_generate_without_params_samples_with_the_models_defaults(tiny_model_factory, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_factory(), folder)
    write(folder, {"temperature": 0.0})  # greedy: what generate gives without params must be the greedy tokens
    llm = LLM(model=folder, dtype="float32", load_tokenizer=False)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0)
    greedy = llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=16))[0].token_ids
    sampled = llm.generate([1, 2, 3], SamplingParams(temperature=1.0, seed=1, max_tokens=16))[0].token_ids
    assert sampled != greedy  # else the test could not tell the two apart
    assert llm.generate([1, 2, 3])[0].token_ids == greedy[: SamplingParams().max_tokens]


def test_a_generation_config_folder_without_one_is_refused_before_the_server_starts(tmp_path):
    from graphrt.server import ServeOptions

    with pytest.raises(ValueError, match="no generation_config.json there"):
        ServeOptions(generation_config=str(tmp_path))
