"""The default pretrained model: the same greedy tokens as transformers, and a right answer."""

from __future__ import annotations

import pytest
import torch
import transformers
from click.testing import CliRunner

from graphrt import LLM, SamplingParams
from graphrt.cli import main

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a CUDA graph is in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Who wrote Romeo and Juliet?",
]
NEW_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_reference(default_model):
    """transformers' greedy continuation of each chat prompt, one prompt at a time."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    references = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        references.append((ids[0].tolist(), out[0, ids.shape[1] :].tolist()))
    return references


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_greedy_tokens_identical_to_transformers(default_model, hf_reference, pp):
    llm = LLM(pp=pp, dtype="float32")
    assert llm.model_dir == default_model
    prompts = [llm.chat_prompt(p) for p in PROMPTS]
    assert prompts == [ids for ids, _ in hf_reference]  # same chat template, same tokens
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for output, (_, expected) in zip(outputs, hf_reference):
        assert output.token_ids == expected
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks - 1  # every block returned


def test_generate_cli_answers_paris(default_model):
    """What `make run` runs: a chat prompt through the console script's function (`graphrt.cli:main`),
    answer on stdout. In this process: a fresh interpreter adds only its start-up, and the CLI runs in
    one in tests/profiling/test_nvtx.py."""
    result = CliRunner().invoke(main, ["generate", "--chat", "--prompt", "What is the capital of France?", "--pp", "2"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr and "GB/s" in result.stderr
