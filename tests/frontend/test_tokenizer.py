"""The tokenizer's EOS id read from its files, as the server's engine process does instead of
loading transformers (seconds of its start-up): the id transformers' tokenizer has, or None where
the files leave it open, and then the engine loads the tokenizer after all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from graphrt.errors import RequestError
from graphrt.frontend.tokenizer import Tokenizer, eos_token_id_from_files
from graphrt.llm import LLM
from graphrt.sampling_params import SamplingParams


def tokenizer_folder(default_model: Path, folder: Path, **config_changes) -> Path:
    """The default model's tokenizer files in `folder`, tokenizer_config.json changed as given
    (a None value removes the key)."""
    folder.mkdir(exist_ok=True)
    shutil.copy(default_model / "tokenizer.json", folder)
    config = json.loads((default_model / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_decode_keeps_special_tokens_only_when_asked(default_model):
    tokenizer = Tokenizer.from_dir(default_model)
    im_start, im_end = tokenizer.encode("<|im_start|>"), tokenizer.encode("<|im_end|>")
    assert (im_start, im_end) == ([1], [2])  # one special token each
    token_ids = tokenizer.encode("Hi") + im_end + tokenizer.encode(" there") + im_start
    assert tokenizer.decode(token_ids) == "Hi there"
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == "Hi<|im_end|> there<|im_start|>"
    # the same one token at a time, as the output processor decodes
    text, prefix_offset, read_offset = "", 0, 0
    for end in range(1, len(token_ids) + 1):
        delta, prefix_offset, read_offset = tokenizer.decode_next(token_ids[:end], prefix_offset, read_offset, skip_special_tokens=False)
        text += delta
    assert text == "Hi<|im_end|> there<|im_start|>"
    assert tokenizer.is_special_token("<|im_end|>") and tokenizer.is_special_token("<|im_start|>")
    assert not tokenizer.is_special_token("Paris") and not tokenizer.is_special_token("<tool_call>")  # a word; several tokens


def test_the_default_models_eos_id_is_the_one_transformers_finds(default_model):
    assert eos_token_id_from_files(default_model) == Tokenizer.from_dir(default_model).eos_token_id == 2


ADDED_TOKEN = {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False,
               "single_word": False, "special": True}


@pytest.mark.parametrize("eos_token", ["<|endoftext|>", ADDED_TOKEN, "Paris"], ids=["special", "added-token-dict", "vocabulary"])
def test_other_eos_tokens_get_the_id_transformers_gives_them(default_model, tmp_path, eos_token):
    # A special token (in added_tokens), one given as an AddedToken dict, a plain vocabulary entry.
    folder = tokenizer_folder(default_model, tmp_path / "tok", eos_token=eos_token)
    expected = Tokenizer.from_dir(folder).eos_token_id
    assert expected not in (None, 2)
    assert eos_token_id_from_files(folder) == expected


def test_the_id_comes_from_tokenizer_json_as_in_transformers(default_model, tmp_path):
    # A tokenizer_config.json whose added_tokens_decoder names another id: transformers' fast
    # tokenizer takes tokenizer.json's.
    folder = tokenizer_folder(default_model, tmp_path / "tok", eos_token="<|im_end|>",
                              added_tokens_decoder={"49000": {"content": "<|im_end|>", "special": True}})
    assert eos_token_id_from_files(folder) == Tokenizer.from_dir(folder).eos_token_id == 2


@pytest.mark.parametrize(
    "case",
    ["no eos_token", "not in any vocabulary", "special_tokens_map disagrees", "no config", "bad json", "no tokenizer.json",
     "tokenizer.json of another shape"],
)
def test_files_that_leave_the_id_open_give_none(default_model, tmp_path, case):
    folder = tokenizer_folder(default_model, tmp_path / "tok")
    if case == "no eos_token":
        tokenizer_folder(default_model, folder, eos_token=None)
    elif case == "not in any vocabulary":
        tokenizer_folder(default_model, folder, eos_token="<no such token>")
    elif case == "special_tokens_map disagrees":
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    elif case == "no config":
        (folder / "tokenizer_config.json").unlink()
    elif case == "bad json":
        (folder / "tokenizer_config.json").write_text("{not json")
    elif case == "no tokenizer.json":
        (folder / "tokenizer.json").unlink()
    else:
        (folder / "tokenizer.json").write_text(json.dumps({"added_tokens": "none", "model": ["a", "list"]}))
    assert eos_token_id_from_files(folder) is None


def test_an_engine_without_its_tokenizer_stops_at_the_same_eos(tiny_model_factory, default_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_factory(), model)
    tokenizer_folder(default_model, model, eos_token="<|endoftext|>")  # id 0, which config.json does not name
    with_tokenizer = LLM(model, dtype="float32")
    without = LLM(model, dtype="float32", load_tokenizer=False)
    assert with_tokenizer.tokenizer is not None and without.tokenizer is None
    assert 0 in with_tokenizer.engine.eos_ids and without.engine.eos_ids == with_tokenizer.engine.eos_ids
    # It takes token ids only, and says why where it is asked for text.
    with pytest.raises(RequestError, match="load_tokenizer=False"):
        without.generate("Hello", SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="stop strings.*load_tokenizer=False"):
        without.generate([1, 2, 3], SamplingParams(max_tokens=2, stop=["x"]))
    assert len(without.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
    # Where the files leave the id open, the engine loads the tokenizer after all.
    tokenizer_folder(default_model, model, eos_token=None)
    fallback = LLM(model, dtype="float32", load_tokenizer=False)
    assert fallback.tokenizer is not None
    for llm in (with_tokenizer, without, fallback):
        llm.engine.close()
