"""Structured outputs through the whole engine (graphrt.engine.grammar).

On a tiny float64 model with a real one-character-per-token tokenizer: every greedy token of a
constrained request is the argmax of transformers' logits of its prefix under the mask xgrammar
gives for that prefix (the reference walks its own matcher), for a JSON schema, any JSON object, a
regex, a choice and an EBNF grammar, beside an unconstrained request that must not change; for
pp 1 and 2, async scheduling on and off, with speculative decoding, under preemption and with the
last stage in a process of its own. A grammar that can end only one way ends that way. Bad grammars
are refused before anything is queued, naming what is wrong; a request waits in the queue while its
grammar compiles.
"""

from __future__ import annotations

import json

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.engine.grammar import GrammarChecks, check_schema_keywords, check_structured_output
from graphrt.errors import RequestError
from graphrt.sampling_params import StructuredOutput
from graphrt.tools.synthetic import make_tiny_model, write_char_tokenizer
from helpers import fail_at_call, hf_model

xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tag", "name", "ok"],
}
SPECS = [
    StructuredOutput(json=SCHEMA),
    StructuredOutput(json_object=True),
    StructuredOutput(regex=r"[a-c]{2,5}(x|yz)"),
    StructuredOutput(choice=["alpha", "beta", "gamma delta"]),
    StructuredOutput(grammar='root ::= "(" [0-9]+ ("," [0-9]+)* ")"'),
]
PROMPTS = [[(7 * i + 5 * j) % 94 + 3 for j in range(3 + 7 * i)] for i in range(len(SPECS) + 1)]
MAX_TOKENS = 64
OPTIONS = dict(dtype="float64", kv_cache_tokens=2048, prefill_chunk_size=16, buckets=[1, 2, 4, 8])
EOS = 2  # the tokenizer's </s>, LlamaConfig's EOS


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("structured") / "model", "llama3-rope")
    return write_char_tokenizer(path)


def params_for(spec: StructuredOutput | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_output=spec)


ALL_PARAMS = [params_for(spec) for spec in SPECS] + [params_for(None)]


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of transformers' logits masked by xgrammar's matcher, step by step."""
    hf = hf_model(model, torch.float64)
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model), vocab_size=97, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)

    def compile_spec(spec: StructuredOutput):
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.json, any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.regex)
        if spec.kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return compiler.compile_grammar(spec.grammar)

    def tokens(prompt: list[int], spec: StructuredOutput | None) -> list[int]:
        matcher = xgr.GrammarMatcher(compile_spec(spec)) if spec is not None else None
        out: list[int] = []
        while len(out) < MAX_TOKENS:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            if matcher is not None:
                bitmask = xgr.allocate_token_bitmask(1, 97)
                matcher.fill_next_token_bitmask(bitmask)
                allowed = torch.tensor([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(97)], dtype=torch.bool)
                logits = logits.masked_fill(~allowed, -torch.inf)
            token = int(logits.argmax())
            out.append(token)
            if token == EOS:
                break
            if matcher is not None:
                assert matcher.accept_token(token)
        return out

    return {index: tokens(prompt, p.structured_output) for index, (prompt, p) in enumerate(zip(PROMPTS, ALL_PARAMS))}


@pytest.mark.parametrize(
    "pp, depth, async_scheduling, speculative, kv_cache_tokens",
    [
        (1, 0, False, None, 2048),
        (1, 0, True, None, 2048),
        (2, 1, True, None, 2048),
        (1, 0, True, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, 2048),
        (2, 0, False, None, 128),  # a cache too small for all at once: requests are preempted and recomputed
        (2, 1, True, None, "procs"),  # the last stage in a process of its own: the masks cross the wire
    ],
)
def test_greedy_tokens_are_the_argmax_under_the_reference_mask(model, reference, pp, depth, async_scheduling, speculative, kv_cache_tokens):
    procs = kv_cache_tokens == "procs"
    kv_cache_tokens = 2048 if procs else kv_cache_tokens
    llm = LLM(model=model, **{**OPTIONS, "kv_cache_tokens": kv_cache_tokens}, pp=pp, depth=depth, procs=procs,
              async_scheduling=async_scheduling, speculative_config=speculative, block_size=8, **({"watchdog_s": 30} if procs else {}))
    if speculative:
        llm.engine.scheduler.speculation.step_costs = None  # every draft proposed is verified
    outs = llm.generate(PROMPTS, ALL_PARAMS)
    assert [o.token_ids for o in outs] == [reference[i] for i in range(len(PROMPTS))]
    if kv_cache_tokens < 2048:
        assert llm.engine.scheduler.num_preemptions > 0
    if speculative:
        assert llm.engine.stats.spec.num_draft_tokens > 0
    # The constraints held: each constrained output ended at EOS and matches its grammar.
    texts = [o.text for o in outs]
    assert all(o.finish_reason == "stop" for o in outs[:3])
    parsed = json.loads(texts[0])
    assert set(parsed) == set(SCHEMA["required"]) and parsed["tag"] in ("red", "green", "blue")
    assert isinstance(json.loads(texts[1]), dict)
    llm.engine.close()


def test_the_constraint_changes_the_output_and_the_grammar_ends_it_its_only_way(model, reference):
    llm = LLM(model=model, **OPTIONS)
    plain = llm.generate(PROMPTS[:3], params_for(None))
    assert all(p.token_ids != reference[i] for i, p in enumerate(plain))
    only_way = StructuredOutput(regex=r"(ab|cd)e!")
    outs = llm.generate(PROMPTS, params_for(only_way))
    assert all(o.text in ("abe!", "cde!") and o.token_ids[-1] == EOS and o.finish_reason == "stop" for o in outs)
    choice = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured_output=SPECS[3]))
    assert all(o.text in SPECS[3].choice for o in choice)
    assert llm.engine.grammars.num_constrained == 2 * len(PROMPTS)
    llm.engine.close()


def test_seeded_sampling_under_a_grammar_matches_its_regex_and_repeats(model):
    llm = LLM(model=model, **OPTIONS)
    params = SamplingParams(max_tokens=30, temperature=1.5, top_p=0.95, seed=11, structured_output=StructuredOutput(regex=r"[0-9a-f]{4}-[xyz]+"))
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)
    import re

    for out in first:
        assert re.fullmatch(r"[0-9a-f]{4}-[xyz]+", out.text) and out.finish_reason == "stop", out.text
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    llm.engine.close()


def test_a_request_waits_in_the_queue_until_its_grammar_is_compiled(model):
    llm = LLM(model=model, **OPTIONS)
    engine = llm.engine
    slow = StructuredOutput(regex=r"[a-z]{3}9")
    gate = __import__("threading").Event()
    engine.grammars.compile(StructuredOutput(regex="x"))  # the compile thread and its tokenizer exist
    engine.grammars._executor.submit(gate.wait)  # holds the grammar thread: the next grammar waits behind it
    constrained = engine.add_request(PROMPTS[0], params_for(slow))
    free = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0))
    for _ in range(20):
        engine.step()
    assert constrained in engine.scheduler.waiting and not constrained.output_ids and not constrained.block_ids
    assert free.finished  # the request behind it went on
    gate.set()
    while engine.has_work():
        engine.step()
    tokenizer = llm.tokenizer
    assert constrained.finish_reason.value == "stop" and tokenizer.decode(constrained.output_ids).endswith("9")
    engine.close()


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutput(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "'not' at properties.a"),
        (StructuredOutput(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "'uniqueItems'"),
        (StructuredOutput(json={"allOf": [{"type": "integer"}, {"minimum": 3}]}), "'allOf' with more than one schema"),
        (StructuredOutput(json={"type": "string", "format": "iri"}), "format 'iri'"),
        (StructuredOutput(json={"type": "strng"}), 'Unsupported type "strng"'),
        (StructuredOutput(json="{not json"), "not valid JSON"),
        (StructuredOutput(json="[1, 2]"), "must be a JSON schema"),
        (StructuredOutput(regex="(ab"), "structured_output.regex cannot be used"),
        (StructuredOutput(grammar="root ::= "), "structured_output.grammar cannot be used"),
    ],
)
def test_a_bad_grammar_is_refused_naming_what_is_wrong(model, spec, message):
    with pytest.raises(RequestError, match=None) as caught:
        check_structured_output(spec)
    assert message in str(caught.value)


def test_keywords_are_checked_where_schemas_are_not_in_property_names():
    check_schema_keywords({"type": "object", "properties": {"not": {"type": "string"}, "if": {"format": "email"}}})
    check_schema_keywords({"type": "string", "format": "date-time"})
    with pytest.raises(RequestError, match=r"'if' at \$defs.x.items"):
        check_schema_keywords({"$defs": {"x": {"type": "array", "items": {"if": {}}}}})


def test_structured_output_takes_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutput()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutput(choice=[])
    assert SamplingParams(structured_output={"regex": "a+"}).structured_output == StructuredOutput(regex="a+")
    # A schema keeps its property order: properties are generated in the order given.
    assert list(json.loads(StructuredOutput(json={"b": 1, "a": 2}).json)) == ["b", "a"]


def test_a_model_without_a_tokenizer_refuses_structured_output(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("llama-gqa-tied"), dtype="float64", kv_cache_tokens=256, load_tokenizer=False)
    with pytest.raises(RequestError, match="needs the model's tokenizer"):
        llm.engine.add_request([3, 4, 5], params_for(StructuredOutput(regex="a")))
    llm.engine.close()


@pytest.mark.parametrize("async_scheduling, defer_masks", [(True, True), (True, False), (False, False)], ids=["async", "async-gpu-rule", "sync"])
def test_metrics_count_constrained_requests_compile_times_and_rows_waiting_on_a_mask(model, async_scheduling, defer_masks, monkeypatch):
    """Where the last stage samples on a thread (a CPU) a constrained row's mask is made after it is
    launched and no row waits; where it cannot (a GPU: forced here) rows wait for their tokens."""
    from graphrt.engine.core import EngineCore
    from graphrt.runtime.logits_plan import PendingMasks
    from graphrt.server.metrics import ServerMetrics

    fills = []
    try_fill = PendingMasks.try_fill
    monkeypatch.setattr(PendingMasks, "try_fill", lambda self, plan: (fills.append(len(self.rows)), try_fill(self, plan)))
    llm = LLM(model=model, **OPTIONS, async_scheduling=async_scheduling)
    assert llm.engine.scheduler.defer_masks == async_scheduling  # this CPU's ring can wait for a mask
    llm.engine.scheduler.defer_masks = defer_masks
    core = EngineCore(llm.engine)
    params = [params_for(SPECS[2]), params_for(SPECS[2]), params_for(None)]
    for index, p in enumerate(params):
        assert core.add(index, [PROMPTS[index]], [p]).__class__.__name__ == "Admitted"
    most_waiting = 0
    while llm.engine.has_work():
        core.step()
        most_waiting = max(most_waiting, core.snapshot().num_waiting_on_mask)
    snap = core.snapshot()
    assert snap.num_constrained == 2 and sum(snap.grammar_compile_counts) == 1  # one grammar, compiled once
    # Held back while an unconstrained row runs ahead only under async scheduling without deferred masks.
    assert (most_waiting > 0) == (async_scheduling and not defer_masks)
    assert (len(fills) > 0) == defer_masks
    text = ServerMetrics(lambda: snap).render().decode()
    assert "graphrt_structured_output_requests_total 2.0" in text and 'graphrt_grammar_compile_seconds_count 1.0' in text
    llm.engine.close()


def test_past_the_grammars_end_ignore_eos_goes_on_unconstrained_and_min_tokens_is_refused(model):
    llm = LLM(model=model, **OPTIONS)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, structured_output=StructuredOutput(regex="ab")))[0]
    assert out.token_ids[:3] == [3 + ord("a") - 32, 3 + ord("b") - 32, EOS] and len(out.token_ids) == 12
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_output"):
        SamplingParams(min_tokens=2, structured_output=StructuredOutput(regex="ab"))
    llm.engine.close()


def test_a_grammar_that_fails_to_compile_ends_its_request_saying_why(model, monkeypatch):
    """xgrammar reads the grammar (the check before queueing) but will not compile it against the
    vocabulary (injected: no such grammar is known for xgrammar 0.2.8): LLM.generate returns that
    request with finish_reason "error" and xgrammar's reason, and the other prompt's output as ever."""
    uncompilable = 'root ::= "x" "y"'
    compile_grammar = xgr.GrammarCompiler.compile_grammar

    def compile_or_refuse(self, grammar, **options):
        if grammar == uncompilable:
            raise RuntimeError("the grammar's automaton is too large")
        return compile_grammar(self, grammar, **options)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", compile_or_refuse)
    llm = LLM(model=model, **OPTIONS)
    failed, fine = llm.generate(PROMPTS[:2], [params_for(StructuredOutput(grammar=uncompilable)), params_for(SPECS[4])])
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "structured_output.grammar passed the checks but failed to compile" in failed.error
    assert "the grammar's automaton is too large" in failed.error
    assert fine.finish_reason == "stop" and fine.error is None and fine.text.startswith("(")
    llm.engine.close()


@pytest.mark.parametrize("failing_stage", [0, 1])
def test_a_stage_failure_while_a_mask_is_pending_leaves_the_engine_serving(model, failing_stage):
    """A constrained row rides behind the micro-batch sampling its token, and the last stage waits
    for its mask: when a stage fails meanwhile, nothing waits for a read-back that will not come
    (the ring lets go of the pending masks before it drains), and the next requests are served."""
    import threading

    from graphrt.errors import StageError

    llm = LLM(model=model, **OPTIONS, pp=2, depth=1, async_scheduling=True)
    engine = llm.engine
    assert engine.scheduler.defer_masks
    fail_at_call(engine.pipeline.stages[failing_stage], 12)
    params = [params_for(SPECS[i % 2]) for i in range(4)]
    seqs = [engine.add_request(PROMPTS[i], p) for i, p in enumerate(params)]
    raised = []

    def run() -> None:
        try:
            while engine.has_work():
                engine.step()
        except StageError as exc:
            raised.append(exc)
        while engine.has_work():  # requests not in flight go on
            engine.step()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the engine hung on a pending mask after a stage failure"
    assert raised and "injected fault" in str(raised[0])
    assert any(s.finish_reason is not None and s.finish_reason.value == "error" for s in seqs)
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1
    again = llm.generate([PROMPTS[0]], [params_for(SPECS[0])])[0]
    assert again.finish_reason == "stop" and set(json.loads(again.text)) == set(SCHEMA["required"])
    engine.close()


def test_closing_with_a_mask_pending_does_not_wait_for_it(model):
    """Shutting down with a constrained row in flight whose mask waits for a read-back that will
    not come: close lets go of it (the stage workers would otherwise sit out their join timeout)."""
    import threading
    import time

    llm = LLM(model=model, **OPTIONS, pp=2, depth=1, async_scheduling=True)
    engine = llm.engine
    last = engine.pipeline.stages[-1]
    forward = last.forward
    last.forward = lambda x, meta, cache: (time.sleep(0.05), forward(x, meta, cache))[1]  # the producer is still out

    def pending() -> bool:
        return any(
            mb.logits_plan is not None and mb.logits_plan.pending is not None and not mb.logits_plan.pending.ready.is_set()
            for mb in engine.ring.in_flight
        )

    for i in range(2):
        engine.add_request(PROMPTS[i], params_for(SPECS[0]))
    while engine.has_work() and not pending():
        engine.step()
    assert pending(), "no constrained row was launched ahead of its token"
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(timeout=20)  # a stage worker's join waits up to 30 s
    assert not closer.is_alive(), "close waited for a mask that no read-back would fill"


def test_masks_after_a_draft_that_is_the_stop_token_allow_everything(model):
    """A verify row's drafts may end the grammar (the stop token) before the last of them: the
    entries after it get every token (never kept: the row ends at the stop token), with no call
    into a terminated matcher, which xgrammar refuses."""
    from transformers import AutoTokenizer

    from graphrt.engine.grammar import Grammars

    grammars = Grammars(model, 100, [EOS])
    state = grammars.compile(StructuredOutput(choice=["ab"]))
    state.wait(60)
    assert state.ready() and state.failure is None
    tokenizer = AutoTokenizer.from_pretrained(model)
    a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
    words = (100 + 31) // 32
    masks = state.masks([a, b, EOS, a])  # entries after "", "a", "ab", "ab</s>", "ab</s>a"

    def allowed(entry: int) -> set[int]:
        row = masks[entry * words : (entry + 1) * words]
        return {t for t in range(100) if (row[t // 32] >> (t % 32)) & 1}

    assert allowed(0) == {a} and allowed(1) == {b} and allowed(2) == {EOS}
    assert allowed(3) == allowed(4) == set(range(100))
    assert state.masks([]) == masks[:words]  # the matcher is back where it was
    grammars.close()


def test_a_failed_read_back_with_a_mask_pending_fails_the_requests_and_the_engine_goes_on(model, monkeypatch):
    """A bug while handing a micro-batch's tokens to the scheduler, with a constrained row behind it
    waiting for its mask: the server's core fails every job in flight (its rule for engine bugs),
    and nothing waits for the mask that read-back was to make: the next request is answered."""
    import threading
    import time

    from graphrt.engine.core import EngineCore

    llm = LLM(model=model, **OPTIONS, pp=2, depth=1, async_scheduling=True)
    engine = llm.engine
    last = engine.pipeline.stages[-1]
    forward = last.forward
    last.forward = lambda x, meta, cache: (time.sleep(0.02), forward(x, meta, cache))[1]  # the producer is still out
    scheduler, update = engine.scheduler, engine.scheduler.update_from_output
    failed_once = []

    def update_failing_once(*args, **kwargs):
        if not failed_once and any(
            mb.logits_plan is not None and mb.logits_plan.pending is not None for mb in engine.ring.in_flight
        ):
            failed_once.append(1)
            raise RuntimeError("a bug in the update")
        return update(*args, **kwargs)

    monkeypatch.setattr(scheduler, "update_from_output", update_failing_once)
    core = EngineCore(engine)
    for index in range(2):
        core.add(index, [PROMPTS[index]], [params_for(SPECS[0])])
    failures = []

    def run() -> None:
        while engine.has_work():
            failures.extend(core.step()[1])
        core.add("after", [PROMPTS[0]], [params_for(SPECS[0])])
        while engine.has_work():
            core.step()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the engine hung on a mask a failed read-back was to make"
    assert failed_once and {key for key, _ in failures} == {0, 1}
    engine.close()


def test_a_grammar_that_passes_is_checked_once_and_a_bad_one_every_time(monkeypatch):
    """An agent sends one schema with every request; xgrammar's parser prints its warnings (a
    `format` beside `minLength`, which it drops) each time it runs: three lines a request before."""
    import xgrammar

    parsed = []
    for name in ("from_json_schema", "from_regex"):
        real = getattr(xgrammar.Grammar, name)
        monkeypatch.setattr(xgrammar.Grammar, name, lambda text, *args, _real=real, **kwargs: parsed.append(text) or _real(text, *args, **kwargs))
    url = json.dumps({"type": "object", "properties": {"site": {"type": "string", "format": "uri", "minLength": 1}}})
    checks = GrammarChecks()
    for _ in range(3):
        checks.check(StructuredOutput(json=url))
    assert parsed == [url]
    for _ in range(2):
        with pytest.raises(RequestError, match="cannot be used"):
            checks.check(StructuredOutput(regex="("))
    assert parsed == [url, "(", "("]
    GrammarChecks().check(StructuredOutput(json=url))  # each owner remembers its own
    assert parsed == [url, "(", "(", url]
