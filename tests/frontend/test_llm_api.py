"""`LLM` as a vLLM user writes it by habit: the prompt forms vLLM takes, `sampling_params=` and
`n`, `outputs[i]` with `stop_reason` and `cumulative_logprob`, `chat` and `get_tokenizer`; and what
its mistakes get: a typo'd option named with its likely meaning, a failed start that leaves the next
one working, an interrupted `generate` whose requests are aborted, not left to run."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.config import parse_dtype

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [5, 9, 13, 2, 7]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> LLM:
    return LLM(model=tiny_model_factory(), dtype="float64", load_tokenizer=False, kv_cache_tokens=1024)


@pytest.fixture(scope="module")
def default_llm(default_model) -> LLM:
    return LLM(model=default_model, dtype="float32", max_model_len=512)


def test_every_prompt_form_vllm_takes_gives_the_same_tokens(tiny):
    want = tiny.generate(PROMPT, GREEDY)[0].token_ids
    forms = [
        {"prompt_token_ids": PROMPT}, [{"prompt_token_ids": PROMPT}], tuple(PROMPT), np.array(PROMPT),
        torch.tensor(PROMPT), [np.array(PROMPT, dtype=np.int32)], (p for p in [PROMPT]), [[np.int64(t) for t in PROMPT]],
    ]
    for form in forms:
        outputs = tiny.generate(form, sampling_params=GREEDY)
        assert len(outputs) == 1 and outputs[0].token_ids == want, type(form)
        assert outputs[0].prompt_token_ids == PROMPT
    batch = tiny.generate(torch.tensor([PROMPT, PROMPT]), GREEDY)
    assert [o.token_ids for o in batch] == [want, want]
    assert tiny.generate([], GREEDY) == []


@pytest.mark.parametrize("prompts, message", [
    (5, "prompts must be a text, a list of token ids, or a dict"),
    ([1.5, 2.0], "prompt 0 must be a text, a list of token ids"),
    ([[1, 2], [True, 3]], "prompt 1 must be"),
    (range(3), "prompt 0 must be .* got int \\(token ids of one prompt go in a list\\)"),
    ({"prompt_token_ids": [1], "multi_modal_data": {}}, "'multi_modal_data', which graphrt does not take"),
    ({}, "needs exactly one of them"),
])
def test_a_prompt_of_no_form_says_which_and_what_the_forms_are(tiny, prompts, message):
    with pytest.raises(TypeError, match=message):
        tiny.generate(prompts, GREEDY)
    assert not tiny.engine.has_work()  # nothing of the call was admitted


def test_n_outputs_sample_as_separate_requests_with_seeds_counting_up(tiny):
    params = SamplingParams(n=3, seed=11, max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=1)
    together = tiny.generate([PROMPT, PROMPT[:3]], params)
    for output, prompt in zip(together, [PROMPT, PROMPT[:3]]):
        alone = [tiny.generate(prompt, SamplingParams(seed=11 + i, max_tokens=8, temperature=1.0, ignore_eos=True))[0] for i in range(3)]
        assert [o.index for o in output.outputs] == [0, 1, 2]
        assert [o.token_ids for o in output.outputs] == [a.token_ids for a in alone]
        assert len({tuple(o.token_ids) for o in output.outputs}) > 1  # else the seeds could be ignored unseen
        assert output.token_ids == output.outputs[0].token_ids and output.finish_reason == output.outputs[0].finish_reason
        for completion in output.outputs:
            assert completion.cumulative_logprob == pytest.approx(sum(entry.logprob for entry in completion.logprobs))
    assert together[0].request_id != together[1].request_id
    assert tiny.generate(PROMPT, GREEDY)[0].outputs[0].cumulative_logprob is None  # no logprobs asked


def test_stop_reason_names_the_stop_token_or_string(tiny, default_llm):
    greedy = tiny.generate(PROMPT, GREEDY)[0].token_ids
    stopped = tiny.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[greedy[2]]))[0]
    assert stopped.token_ids == greedy[: greedy.index(greedy[2]) + 1]
    assert stopped.outputs[0].stop_reason == greedy[2] and stopped.finish_reason == "stop"
    assert tiny.generate(PROMPT, GREEDY)[0].outputs[0].stop_reason is None  # ended by max_tokens
    by_string = default_llm.generate("The capital of France is", SamplingParams(max_tokens=12, temperature=0, stop=[" Paris"]))[0]
    assert by_string.outputs[0].stop_reason == " Paris" and by_string.finish_reason == "stop"
    # EOS is no stop reason, even listed in stop_token_ids (as vLLM): the answer ends on it
    eos = sorted(default_llm.engine.eos_ids)
    ended = default_llm.generate(default_llm.chat_prompt("What is the capital of France?"), SamplingParams(max_tokens=32, temperature=0, stop_token_ids=eos))[0]
    assert ended.finish_reason == "stop" and ended.outputs[0].stop_reason is None


def test_chat_renders_conversations_with_text_parts_as_chat_prompt_does(default_llm):
    params = SamplingParams(max_tokens=8, temperature=0)
    question = "What is the capital of France?"
    want = default_llm.generate(default_llm.chat_prompt(question), params)[0].text
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]}]
    assert default_llm.chat(parts, params)[0].text == want
    both = default_llm.chat([[{"role": "user", "content": question}], parts], sampling_params=params)
    assert [o.text for o in both] == [want, want]
    tokenizer = default_llm.get_tokenizer()
    assert default_llm.chat_prompt(question) == tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]
    with pytest.raises(TypeError, match="for a conversation .* use LLM.chat"):
        default_llm.chat_prompt([{"role": "user", "content": question}])


def test_an_interrupted_generate_aborts_its_requests(tiny):
    engine, step = tiny.engine, tiny.engine.step
    want = tiny.generate(PROMPT, GREEDY)[0].token_ids
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            tiny.generate([PROMPT, PROMPT[:2]], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    finally:
        del engine.step
    assert not engine.scheduler.has_work()  # nothing left to schedule: the next call runs only its own
    assert tiny.generate(PROMPT, GREEDY)[0].token_ids == want


def test_a_typo_in_an_option_names_the_option_it_was_likely_meant_to_be(tiny_model_factory):
    with pytest.raises(TypeError, match="no engine option 'max_num_seq'; did you mean max_num_seqs"):
        LLM(model=tiny_model_factory(), max_num_seq=4)
    with pytest.raises(TypeError, match="enforce_eager is vLLM's: pass use_graphs=False"):
        LLM(model=tiny_model_factory(), enforce_eager=True)


# A fresh interpreter: transformers not imported yet, as in a user's script or notebook.
RETRY = """
from graphrt import LLM
try:
    LLM(dtype="float32", max_num_seq=4)
except TypeError:
    pass
print(LLM(dtype="float32", max_model_len=256).generate("Hi")[0].prompt_token_ids)
"""


def test_a_failed_start_leaves_the_next_one_working(default_model):
    """The tokenizer loads on a thread beside the weights; a start that failed at once used to leave
    transformers half imported, and the next LLM() failed with an ImportError."""
    result = subprocess.run([sys.executable, "-c", RETRY], capture_output=True, text=True, timeout=300, env=os.environ)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith("[")


@pytest.mark.parametrize("max_model_len, message", [
    (0, "max_model_len must be a positive number of tokens"),
    (-5, "max_model_len must be a positive number of tokens"),
    (257, "max_model_len 257 is longer than .* can attend to \\(256 positions"),
])
def test_max_model_len_beyond_the_model_or_below_one_is_refused(tiny_model_factory, max_model_len, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_model_factory(), max_model_len=max_model_len)


def test_sampling_params_take_vllms_spellings():
    params = SamplingParams(stop=None, stop_token_ids=(2, 3), bad_words=None, top_k=-1)
    assert (params.stop, params.stop_token_ids, params.bad_words, params.top_k) == ([], [2, 3], [], 0)
    assert SamplingParams(stop="x").stop == ["x"]
    assert parse_dtype("half") == torch.float16 and parse_dtype("float") == torch.float32


@pytest.mark.parametrize("field, value", [
    ("temperature", "0.7"), ("temperature", None), ("top_p", "0.9"), ("max_tokens", True), ("top_k", True),
    ("seed", True), ("ignore_eos", "yes"), ("n", 0), ("n", 1.0), ("top_k", -2),
])
def test_sampling_params_name_a_value_of_the_wrong_type(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_the_default_models_hub_id_names_it_and_another_hub_id_says_to_download(default_model, tmp_path, monkeypatch):
    from graphrt.errors import ModelLoadError
    from graphrt.model.default_model import DEFAULT_MODEL_HUB_ID, model_dir_for

    assert model_dir_for(DEFAULT_MODEL_HUB_ID) == model_dir_for(None) == default_model
    monkeypatch.chdir(tmp_path)  # a folder of that name here is the user's own, and wins
    (tmp_path / DEFAULT_MODEL_HUB_ID).mkdir(parents=True)
    assert model_dir_for(DEFAULT_MODEL_HUB_ID) == tmp_path.joinpath(DEFAULT_MODEL_HUB_ID).relative_to(tmp_path)
    with pytest.raises(ModelLoadError, match="graphrt reads local folders, not hub ids: `hf download Qwen/Qwen3-0.6B --local-dir DIR` first"):
        LLM(model="Qwen/Qwen3-0.6B")
