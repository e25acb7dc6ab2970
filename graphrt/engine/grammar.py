"""Grammar-constrained decoding (structured outputs) with xgrammar.

A request with `SamplingParams.structured_output` goes through four places:

- `Engine.add_request` checks its grammar (`check_structured_output`: parsed without the tokenizer,
  in well under a millisecond, so a bad schema is refused with the reason before anything is queued)
  and starts compiling it against the vocabulary on the grammar thread (`Grammars.compile`; compiled
  grammars are cached by their text).
- The scheduler admits it once that is done: until then it waits in the queue, never in the ring,
  and the requests behind it go on. Every stage follows, since only stage 0's host schedules.
- When a micro-batch is launched, its logits plan takes from each constrained row's `GrammarState`
  the mask of the tokens the grammar allows next (for a verify row, after each of its drafts), packed
  32 tokens to an int32 word as xgrammar fills them; the last stage masks the logits with it before
  anything else is done to them (graphrt.runtime.logits_processors). The graphs never change.
- Each token read back advances the matcher (`Scheduler._append`). A row's next mask needs its
  newest token. Where the last stage samples on a thread of its own (a CPU), a constrained row rides
  in the next micro-batch anyway, launched before that token is back: its mask is made right after
  the read-back and the last stage waits for it just before masking (`PendingMasks`). Elsewhere (a
  GPU, whose host enqueues the sampling at launch; stage processes) the row runs again only once
  its token is back on the host; the other rows of the micro-batch keep async scheduling's overlap.

A grammar ends the output with a stop token (the model's EOS): once it is complete, the mask allows
only those.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from graphrt.errors import RequestError, RequestFailure
from graphrt.sampling_params import StructuredOutput

logger = logging.getLogger("graphrt")

# JSON Schema keywords xgrammar 0.2 accepts but does not enforce: a schema using one is refused, not
# served with output that may break it.
UNENFORCED_KEYWORDS = {
    "not": "negation",
    "uniqueItems": "unique array items",
    "dependentRequired": "properties required by others",
    "if": "conditional schemas",
    "then": "conditional schemas",
    "else": "conditional schemas",
    "contentEncoding": "encoded string content",
    "contentMediaType": "encoded string content",
    "contentSchema": "encoded string content",
}
# The string formats xgrammar enforces (tried one by one); any other format is refused.
ENFORCED_FORMATS = {
    "email", "date", "date-time", "time", "duration", "uuid", "uri", "uri-reference", "hostname", "ipv4", "ipv6",
    "json-pointer",
}
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Compiled grammars kept for requests that send the same one again; past these, the oldest go. A
# server whose every request brings a new schema (tools' schemas, say) would otherwise grow forever.
MAX_CACHED_GRAMMARS = 1024
MAX_CHECKED_GRAMMARS = 1024  # digests of grammars that passed their check (GrammarChecks)
COMPILER_CACHE_BYTES = 256 << 20  # xgrammar's own cache of compiled pieces
COMPILE_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _xgrammar():
    import xgrammar

    return xgrammar


def check_structured_output(spec: StructuredOutput) -> None:
    """Raise RequestError saying what is wrong with a request's grammar, without its tokenizer."""
    xgr = _xgrammar()
    kind, text = spec.key()
    if kind == "json":
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise RequestError(f"structured_output.json is not valid JSON ({exc}); send a JSON schema") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"structured_output.json must be a JSON schema (an object), got {type(schema).__name__}")
        check_schema_keywords(schema)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
    except Exception as exc:  # xgrammar raises RuntimeError or ValueError with the parser's message
        raise RequestError(f"structured_output.{kind} cannot be used: {xgrammar_reason(exc)}") from None


class GrammarChecks:
    """check_structured_output, once for each grammar that passes: an agent sends the same schema
    with every request, and xgrammar's parser prints its warnings (a `format` beside `minLength`,
    which it drops) to stderr each time it runs. The last MAX_CHECKED_GRAMMARS that passed are
    remembered by digest (a schema may be a megabyte); one that fails is checked every time."""

    def __init__(self) -> None:
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # the server checks on worker threads

    def check(self, spec: StructuredOutput) -> None:
        kind, text = spec.key()
        digest = hashlib.sha256(f"{kind}\0{text}".encode()).digest()
        with self._lock:
            if digest in self._passed:
                self._passed.move_to_end(digest)
                return
        check_structured_output(spec)
        with self._lock:
            self._passed[digest] = None
            if len(self._passed) > MAX_CHECKED_GRAMMARS:
                self._passed.popitem(last=False)


def xgrammar_reason(exc: Exception) -> str:
    """The reason in an xgrammar error: its last line, without the timestamp, C++ file and line
    its messages start with."""
    message = str(exc).strip()
    if not message:
        return type(exc).__name__
    head, sep, rest = message.splitlines()[-1].partition(": ")
    return rest if sep and (".cc:" in head or ".h:" in head) else head + sep + rest


def check_schema_keywords(schema: Any) -> None:
    """Refuse JSON Schema keywords the grammar would not enforce, naming the keyword and where it is."""
    pending: list[tuple[str, Any]] = [("", schema)]
    while pending:
        path, node = pending.pop()
        if not isinstance(node, dict):
            continue
        where = f" at {path}" if path else ""
        for keyword, what in UNENFORCED_KEYWORDS.items():
            if keyword in node:
                raise RequestError(
                    f"structured_output.json: the schema keyword {keyword!r}{where} ({what}) is not supported; "
                    "remove it, or check that property after the response"
                )
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise RequestError(f"structured_output.json: 'allOf' with more than one schema{where} is not supported; merge them into one")
        fmt = node.get("format")
        if isinstance(fmt, str) and node.get("type") in ("string", None) and fmt not in ENFORCED_FORMATS:
            raise RequestError(
                f"structured_output.json: the string format {fmt!r}{where} is not supported; use a pattern, "
                f"or one of {', '.join(sorted(ENFORCED_FORMATS))}"
            )
        for keyword in _SUBSCHEMA:
            if isinstance(node.get(keyword), dict):
                pending.append((f"{path}.{keyword}" if path else keyword, node[keyword]))
        for keyword in _SUBSCHEMA_LISTS:
            if isinstance(node.get(keyword), list):
                pending += [(f"{path}.{keyword}[{i}]" if path else f"{keyword}[{i}]", item) for i, item in enumerate(node[keyword])]
        for keyword in _SUBSCHEMA_MAPS:
            if isinstance(node.get(keyword), dict):
                pending += [(f"{path}.{keyword}.{name}" if path else f"{keyword}.{name}", item) for name, item in node[keyword].items()]


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are `choices` (JSON's string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class Grammars:
    """Compiles requests' grammars against the model's vocabulary on a thread of its own, and keeps
    them by their text. The tokenizer is loaded there on the first request that needs it."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: list[int]):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._checks = GrammarChecks()
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: Future | None = None
        self._compiled: dict[tuple[str, str], Future] = {}
        # Compile times, as a Prometheus histogram's buckets (graphrt_grammar_compile_seconds).
        self.compile_counts = [0] * (len(COMPILE_SECONDS_BUCKETS) + 1)
        self.compile_seconds_sum = 0.0
        self.num_constrained = 0  # requests added with a grammar, since start

    def prepare(self) -> None:
        """Import xgrammar now, on the grammar thread (it takes seconds): a server calls this at
        start, so its first constrained request does not stall the engine thread, and every
        request running with it, while the module loads."""
        self._thread().submit(_xgrammar)

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="graphrt-grammar")
        return self._executor

    def check(self, spec: StructuredOutput) -> None:
        if not (self.model_dir / "tokenizer.json").is_file() and not (self.model_dir / "tokenizer_config.json").is_file():
            raise RequestError(f"structured_output needs the model's tokenizer, and {self.model_dir} has none")
        self._checks.check(spec)

    def compile(self, spec: StructuredOutput) -> GrammarState:
        """A request's grammar state, ready once its grammar is compiled (at once when cached)."""
        key = spec.key()
        if key not in self._compiled:
            if self._compiler is None:
                self._compiler = self._thread().submit(self._make_compiler)
            if len(self._compiled) >= MAX_CACHED_GRAMMARS:  # the oldest goes (dicts keep insertion order)
                del self._compiled[next(iter(self._compiled))]
            self._compiled[key] = self._executor.submit(self._compile, spec)
        self.num_constrained += 1
        return GrammarState(self._compiled[key], self.vocab_size)

    def _make_compiler(self):
        xgr = _xgrammar()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES)

    def _compile(self, spec: StructuredOutput):
        """The compiled grammar; raises RequestError where xgrammar will not compile the request's
        grammar, and anything else where the compiler itself could not be made (the server's fault)."""
        compiler = self._compiler.result()
        start = time.perf_counter()
        kind = spec.kind
        try:
            if kind == "json":
                # Compact JSON: with any whitespace allowed, small models can emit blank lines forever.
                compiled = compiler.compile_json_schema(spec.json, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choice))
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError or ValueError with its reason
            raise RequestError(
                f"structured_output.{kind} passed the checks but failed to compile against the model's vocabulary: "
                f"{xgrammar_reason(exc)}; simplify the grammar, or drop it and check the output after the response"
            ) from exc
        seconds = time.perf_counter() - start
        self.compile_counts[bisect.bisect_left(COMPILE_SECONDS_BUCKETS, seconds)] += 1
        self.compile_seconds_sum += seconds
        return compiled

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's place in its grammar: xgrammar's matcher, made once the grammar is compiled."""

    def __init__(self, compiled: Future, vocab_size: int):
        self._compiled = compiled
        self.vocab_size = vocab_size
        self.matcher = None
        self.failure: RequestFailure | None = None

    def ready(self) -> bool:
        """Whether its grammar is compiled (or failed to: then `failure` says why, for the client)."""
        if self.matcher is not None or self.failure is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            self.matcher = _xgrammar().GrammarMatcher(self._compiled.result())
        except RequestError as exc:
            logger.warning("a request's grammar failed to compile: %s", exc)
            self.failure = RequestFailure(str(exc), request_fault=True)
        except Exception as exc:
            logger.exception("compiling a request's grammar failed")
            self.failure = RequestFailure(
                f"structured outputs failed on this server ({type(exc).__name__}: {exc}); see the server log", request_fault=False
            )
        return True

    def wait(self, timeout: float) -> None:
        """Until its grammar is compiled, or `timeout` seconds."""
        concurrent.futures.wait([self._compiled], timeout)

    def masks(self, drafts: list[int]) -> list[int]:
        """The allowed tokens of the next 1 + len(drafts) entries, packed (xgrammar's bitmask words,
        flattened): entry j's after drafts[:j]. Entries past a draft the grammar refuses allow every
        token: the target's token before them cannot equal that draft, so they are never kept."""
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(1 + len(drafts), self.vocab_size)  # every token allowed
        if self.matcher.is_terminated():  # past the grammar's end (ignore_eos went on after its stop token)
            return bitmask.view(-1).tolist()
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        accepted = 0
        for draft in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(draft):
                break
            accepted += 1
            if self.matcher.is_terminated():  # that draft was a stop token: nothing after it is kept
                break
            self.matcher.fill_next_token_bitmask(bitmask, accepted)
        if accepted:
            self.matcher.rollback(accepted)
        return bitmask.view(-1).tolist()

    def all_allowed(self) -> list[int]:
        """One entry's mask allowing every token, as `masks` packs it."""
        return [-1] * ((self.vocab_size + 31) // 32)

    def accept(self, token_id: int) -> None:
        """Advance past a token the sampler chose (under this state's mask, so the grammar allows it)."""
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
            logger.warning("a constrained request sampled token %d, which its grammar does not allow", token_id)
