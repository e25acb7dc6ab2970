"""The model folder's tokenizer and chat template, through transformers' fast tokenizer."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from graphrt.errors import ModelLoadError, RequestError
from graphrt.model.eos import eos_token_id_from_files

# A normalizer may merge characters before the vocabulary sees them (NFC composes up to three
# Hangul jamo, or a letter and its accents, into one character), so with one a token may stand
# for more input characters than its vocabulary entry has.
NORMALIZER_SLACK = 4


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.max_chars_per_token = _max_chars_per_token(hf_tokenizer)

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

    def min_num_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of any text of `num_chars` characters, found without tokenizing.

        Lets a server refuse a prompt that cannot fit the context before paying for tokenizing it.
        The bound never exceeds the true count, so no prompt that fits is refused by it.
        """
        return -(-num_chars // self.max_chars_per_token)

    @property
    def hf(self):
        """The Hugging Face tokenizer underneath (what vLLM's LLM.get_tokenizer returns)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can spell (its base vocabulary and added tokens)."""
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok(text, add_special_tokens=add_special_tokens).input_ids

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id as the tokenizer's own piece (`Ġcapital`), not decoded text."""
        return self._tok.convert_ids_to_tokens(token_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def is_special_token(self, text: str) -> bool:
        """`text` is one special token of this tokenizer, which decoding drops unless asked to keep
        special tokens (a tool-call marker such as Mistral's `[TOOL_CALLS]` may be one)."""
        token_ids = self._tok.encode(text, add_special_tokens=False)
        return len(token_ids) == 1 and self.decode(token_ids) == "" and self.decode(token_ids, skip_special_tokens=False) == text

    def decode_token(self, token_id: int) -> str:
        """One token's own text, special tokens included (how logprobs name a token)."""
        return self._tok.decode([token_id])

    def decode_next(
        self, token_ids: list[int], prefix_offset: int, read_offset: int, final: bool = False, skip_special_tokens: bool = True
    ) -> tuple[str, int, int]:
        """The text the newest tokens add, decoding only a short window instead of the whole output.

        `token_ids[prefix_offset:read_offset]` were already turned into text; decoding them again
        together with the new tokens keeps word boundaries right. A trailing partial UTF-8
        character is held back (empty result, offsets unchanged) unless `final`.
        Returns (new text, new prefix_offset, new read_offset).
        """
        prefix_text = self.decode(token_ids[prefix_offset:read_offset], skip_special_tokens)
        text = self.decode(token_ids[prefix_offset:], skip_special_tokens)
        if len(text) > len(prefix_text) and (final or not text.endswith("\ufffd")):
            return text[len(prefix_text):], read_offset, len(token_ids)
        return "", prefix_offset, read_offset

    @property
    def chat_template(self) -> str | None:
        """The chat template's text (all of a model's named templates, one after another), or None."""
        template = self._tok.chat_template
        return "\n".join(template.values()) if isinstance(template, dict) else template

    def use_chat_template(self, template: str) -> None:
        """Render conversations with `template` (Jinja) instead of the model's own (`--chat-template`)."""
        self._tok.chat_template = template

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True, **template_kwargs,
    ) -> str:
        """The prompt text for a conversation, ending where the assistant's reply begins (without
        `add_generation_prompt`, with the last message). `tools`: the functions the model may call,
        as JSON schemas; a template that has no place for them leaves them out. `template_kwargs`:
        transformers' `continue_final_message`, and variables the template reads (`enable_thinking`).

        Raises RequestError naming the message the template cannot render (a role it does not
        know, tool calls it has no place for, roles out of the order it demands).
        """
        if not self._tok.chat_template:
            raise ModelLoadError("this model has no chat template; send a plain prompt instead")
        try:
            return self._render(messages, tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as exc:  # a Jinja template raises whatever its code runs into
            error = self._error_without_tools(messages, add_generation_prompt, template_kwargs) if tools else exc
            if error is None:  # the whole conversation renders without the tools: they are what fails
                raise RequestError(f"tools: the model's chat template cannot render them ({exc})") from None
            index, error = self._first_unrenderable(messages, error, template_kwargs)
            raise RequestError(f"messages[{index}]: the model's chat template cannot render this message ({error})") from None

    def _render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, **template_kwargs) -> str:
        return self._tok.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )

    def _error_without_tools(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> Exception | None:
        """What rendering the whole conversation raises without the tools (None: it renders).

        The whole of it, not its first messages: a template may write the tools into a message of
        the conversation (Llama 3.1's, into the first user message), so part of a conversation may
        fail with the tools for want of that message while the whole renders."""
        try:
            self._render(messages, None, add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as exc:
            return exc
        return None

    def _first_unrenderable(self, messages: list[dict], error: Exception, template_kwargs: dict) -> tuple[int, Exception]:
        """The message whose inclusion makes rendering fail, and the template's error for it, given
        that the whole conversation fails without the tools with `error`.

        Bisects over prefixes (log2 of the number of renders, not one per message) between one
        that renders (or none) and one that fails; the message that ends the failing prefix is it.
        Prefixes render without the tools (with them, a prefix may fail only for lacking the
        message the template writes them into) and without the generation prompt, which a
        template may refuse after an assistant turn; the whole conversation is known to fail with it.
        They render with the template's variables but not `continue_final_message`, which only the
        whole conversation's last message is for.
        """
        variables = {name: value for name, value in template_kwargs.items() if name != "continue_final_message"}
        renders, fails = 0, len(messages)
        while fails - renders > 1:
            middle = (renders + fails) // 2
            try:
                self._render(messages[:middle], None, add_generation_prompt=False, **variables)
                renders = middle
            except Exception as exc:
                fails, error = middle, exc
        return fails - 1, error

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences `SamplingParams.bad_words` ban, as vLLM tokenizes them: each word
        alone, and after a space where that spells it with other tokens of the same count (a word
        at the start of the text and the same word inside it). Raises RequestError for a word that
        is no token at all."""
        sequences: list[list[int]] = []
        for word in words:
            alone = self._tok.encode(word.lstrip(), add_special_tokens=False)
            if not alone:
                raise RequestError(f"bad_words: {word!r} tokenizes to no token; every word must be at least one")
            sequences.append(alone)
            spaced = self._tok.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return sequences

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode_templated(self.apply_chat_template(messages, tools))

    def encode_templated(self, text: str) -> list[int]:
        """Token ids of text a chat template wrote."""
        # The template already writes the special tokens; don't let the tokenizer add a BOS again.
        return self._tok(text, add_special_tokens=False).input_ids


def _max_chars_per_token(hf_tokenizer) -> int:
    """The most input characters one token can cover: its longest vocabulary entry, special tokens
    included. A byte-level vocabulary spells each byte as one character and an input character is
    at least one byte; a SentencePiece one spells a space as one "\u2581" and a byte fallback as
    "<0x..>" (6 characters for 1 byte): either way an entry is at least as long as the text it
    covers. Times NORMALIZER_SLACK where a normalizer (or a slow tokenizer, which we cannot
    inspect) may merge characters first."""
    longest = max(map(len, hf_tokenizer.get_vocab()), default=1)
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)  # only fast tokenizers have one
    merges = backend is None or backend.normalizer is not None
    return longest * NORMALIZER_SLACK if merges else longest


class TokenizerLoading:
    """The tokenizer loading on a thread beside the weights (mostly importing transformers, seconds).

    `load=False` skips it where the model folder's files settle the EOS id (graphrt.model.eos), for
    callers that pass token ids and turn tokens into text themselves; where they leave it open, the
    tokenizer is loaded after all. `eos_token_id` is what the engine waits for (Engine's argument).
    """

    def __init__(self, model_dir: Path, load: bool = True):
        self.eos_from_files = None if load else eos_token_id_from_files(model_dir)
        self.skipped = self.eos_from_files is not None
        self._future: Future | None = None
        if not self.skipped:
            loader = ThreadPoolExecutor(1, thread_name_prefix="graphrt-tokenizer")
            self._future = loader.submit(Tokenizer.from_dir, model_dir)
            loader.shutdown(wait=False)

    def settle(self) -> None:
        """Wait for the loading thread whatever it gives (the engine failed to start): a
        transformers import cut off mid-way would break the next one, in the caller's next try."""
        if self._future is not None:
            wait([self._future])

    def result(self) -> Tokenizer | None:
        """The tokenizer (waiting for it); None where skipped or the folder has none."""
        return self._future.result() if self._future is not None else None

    def eos_token_id(self) -> int | None:
        tokenizer = self.result()
        return tokenizer.eos_token_id if tokenizer is not None else self.eos_from_files
