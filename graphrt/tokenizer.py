"""The model folder's tokenizer and chat template, through transformers' fast tokenizer."""

from __future__ import annotations

from pathlib import Path

from graphrt.errors import ModelLoadError


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id

    @staticmethod
    def from_dir(model_dir: Path) -> Tokenizer | None:
        """None when the folder has no tokenizer: such a model takes prompts as token ids."""
        if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
            return None
        from transformers import AutoTokenizer

        try:
            return Tokenizer(AutoTokenizer.from_pretrained(model_dir))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load the tokenizer in {model_dir} ({exc})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok(text).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def decode_next(self, token_ids: list[int], prefix_offset: int, read_offset: int, final: bool = False) -> tuple[str, int, int]:
        """The text the newest tokens add, decoding only a short window instead of the whole output.

        `token_ids[prefix_offset:read_offset]` were already turned into text; decoding them again
        together with the new tokens keeps word boundaries right. A trailing partial UTF-8
        character is held back (empty result, offsets unchanged) unless `final`.
        Returns (new text, new prefix_offset, new read_offset).
        """
        prefix_text = self.decode(token_ids[prefix_offset:read_offset])
        text = self.decode(token_ids[prefix_offset:])
        if len(text) > len(prefix_text) and (final or not text.endswith("\ufffd")):
            return text[len(prefix_text):], read_offset, len(token_ids)
        return "", prefix_offset, read_offset

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text for a conversation, ending where the assistant's reply begins."""
        if not self._tok.chat_template:
            raise ModelLoadError("this model has no chat template; send a plain prompt instead")
        return self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already writes the special tokens; don't let the tokenizer add a BOS again.
        return self._tok(self.apply_chat_template(messages), add_special_tokens=False).input_ids
