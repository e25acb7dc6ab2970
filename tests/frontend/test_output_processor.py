"""One delta per request per step, from the scheduler to the front, and the front's own state of
each request: text, stop strings (ended as data, for the caller to end in the engine), logprobs."""

from __future__ import annotations

import pytest

from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.scheduler import Scheduler
from graphrt.engine.sequence import FinishReason, Sequence, SequenceOutput
from graphrt.frontend.output_processor import OutputProcessor
from graphrt.frontend.tokenizer import Tokenizer
from graphrt.runtime.logprobs import StepLogprobs
from graphrt.sampling_params import SamplingParams, TokenLogprob

EOS = 2


def scheduler() -> Scheduler:
    return Scheduler(BlockAllocator(64, 4), max_num_seqs=8, prefill_chunk_size=64, max_model_len=64, max_decode_batch=8, eos_ids=frozenset({EOS}))


def test_update_from_output_returns_one_delta_per_request_that_got_a_token():
    sched = scheduler()
    asks = SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=0)
    plain, scored = Sequence(0, [5, 6, 7], SamplingParams(max_tokens=2), 2), Sequence(1, [8, 9], asks, 3)
    for seq in (plain, scored):
        sched.add(seq)
    entries = [TokenLogprob(40 + i, -0.5 - i, ((40 + i, -0.5 - i),)) for i in range(3)]
    outputs = []
    for step_index, tokens in enumerate(([11, 21], [12, EOS])):
        step = sched.schedule()
        assert [s.request_id for s in step.sampled_seqs] == [0, 1]
        prompt = [(1, 1, entries[2])] if step_index == 0 else []
        outputs.append(sched.update_from_output(step, tokens, now=1.0 + step_index, logprobs=StepLogprobs({1: entries[step_index]}, prompt)))
    first, second = outputs
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in first] == [(0, [11], None), (1, [21], None)]
    assert first[0].new_logprobs is None and first[0].prompt_logprobs is None  # it asked for none
    assert first[1].new_logprobs == [entries[0]] and first[1].prompt_logprobs == [None, entries[2]]  # with its first token
    # The last step: max_tokens ends one, EOS the other; the prompt's logprobs came once.
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in second] == [
        (0, [12], FinishReason.LENGTH), (1, [EOS], FinishReason.STOP),
    ]
    assert second[1].new_logprobs == [entries[1]] and second[1].prompt_logprobs is None
    assert scored.logprobs == entries[:2] and plain.output_ids == [11, 12]  # the engine's own sequence, the scheduler's to grow


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    return Tokenizer.from_dir(default_model)


def feed(processor: OutputProcessor, request_id: int, token_ids: list[int]) -> tuple[list, list[int]]:
    """The tokens one per step, as the engine sends them; every step's (states, stopped)."""
    return [processor.process([SequenceOutput(request_id, [token], None)]) for token in token_ids]


def test_a_stop_string_ends_the_request_here_and_says_so_rather_than_calling_the_engine(tokenizer):
    processor = OutputProcessor(tokenizer)  # no engine: ending it there is the caller's
    text = "The capital of France is Paris. It is"
    state = processor.add(7, SamplingParams(stop=["Paris", "France"]))
    steps = feed(processor, 7, tokenizer.encode(text))
    stopped_at = [index for index, (_, stopped) in enumerate(steps) if stopped]
    assert len(stopped_at) == 1 and steps[stopped_at[0]][1] == [7]
    # The stop string that starts first wins, and the text ends where it starts.
    assert state.text.text == "The capital of " and state.finish_reason == "stop" and state.text.num_streamable == len(state.text.text)
    # Tokens the engine had already on the way when it heard of the stop are dropped.
    assert all(states == [] for states, _ in steps[stopped_at[0] + 1:])
    assert len(state.output_ids) == stopped_at[0] + 1


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string_that_starts_first(tokenizer):
    """vLLM's include_stop_str_in_output: where "France" starts first, it stays, and "Paris" (which
    would end the text later) does not."""
    processor = OutputProcessor(tokenizer)
    state = processor.add(7, SamplingParams(stop=["Paris", "France is"], include_stop_str_in_output=True))
    steps = feed(processor, 7, tokenizer.encode("The capital of France is Paris. It is"))
    assert sum(1 for _, stopped in steps if stopped) == 1
    assert state.text.text == "The capital of France is" and state.text.num_streamable == len(state.text.text)


def test_stop_strings_count_once_min_tokens_are_out_and_a_stop_tokens_text_is_left_out(tokenizer):
    """As vLLM: a stop string ends a request only past min_tokens tokens; a stop token (stop_token_ids)
    that ends it is one of its tokens but not of its text."""
    token_ids = tokenizer.encode("The capital of France is Paris. It is")
    processor = OutputProcessor(tokenizer)
    late = processor.add(1, SamplingParams(stop=["capital", "Paris"], min_tokens=3))
    steps = feed(processor, 1, token_ids)
    # "capital" (token 1) comes too early to count, "Paris" (token 5) ends it.
    assert [index for index, (_, stopped) in enumerate(steps) if stopped] == [token_ids.index(tokenizer.encode(" Paris")[0])]
    assert late.text.text == "The capital of France is "
    period = tokenizer.encode(".")[0]
    stopped = processor.add(2, SamplingParams(stop_token_ids=[period]))
    upto = token_ids.index(period) + 1
    processor.process([SequenceOutput(2, token_ids[: upto - 1], None)])
    processor.process([SequenceOutput(2, token_ids[upto - 1 : upto], FinishReason.STOP)])
    assert stopped.output_ids == token_ids[:upto] and stopped.text.text == "The capital of France is Paris"
    # With include_stop_str_in_output (vLLM's reading: the stop token is the stop), its text stays.
    kept = processor.add(3, SamplingParams(stop_token_ids=[period], include_stop_str_in_output=True))
    processor.process([SequenceOutput(3, token_ids[: upto - 1], None)])
    processor.process([SequenceOutput(3, token_ids[upto - 1 : upto], FinishReason.STOP)])
    assert kept.text.text == "The capital of France is Paris."


def test_special_tokens_are_text_only_when_asked_and_the_eos_that_ends_a_request_never_is(tokenizer):
    """As vLLM's skip_special_tokens: <|im_start|> (a special token) mid-output is dropped from the
    text by default and kept with skip_special_tokens=False; the EOS (<|im_end|>) that ends the
    request is one of its tokens but not of its text either way."""
    token_ids = tokenizer.encode("Hi") + [1] + tokenizer.encode(" there") + [2]
    processor = OutputProcessor(tokenizer)
    skipped, kept = processor.add(1, SamplingParams()), processor.add(2, SamplingParams(skip_special_tokens=False))
    for request_id in (1, 2):
        feed(processor, request_id, token_ids[:-1])
        processor.process([SequenceOutput(request_id, token_ids[-1:], FinishReason.STOP)])
    assert skipped.output_ids == kept.output_ids == token_ids
    assert skipped.text.text == "Hi there" and kept.text.text == "Hi<|im_start|> there"
    # Not ended by it (ignore_eos), an EOS is text like any special token.
    longer = processor.add(3, SamplingParams(skip_special_tokens=False, ignore_eos=True))
    feed(processor, 3, token_ids[:-1])
    processor.process([SequenceOutput(3, token_ids[-1:], FinishReason.LENGTH)])
    assert longer.text.text == "Hi<|im_start|> there<|im_end|>"


def test_the_front_state_is_built_from_deltas_alone(tokenizer):
    processor = OutputProcessor(tokenizer)
    state = processor.add(3, SamplingParams(logprobs=0))
    entry = TokenLogprob(10, -1.0, ())
    token_ids = tokenizer.encode("Hello there")
    states, _ = processor.process([SequenceOutput(3, token_ids[:1], None, [entry], [None])])
    assert states == [state] and state.output_ids == token_ids[:1] and state.logprobs == [entry] and state.prompt_logprobs == [None]
    assert not state.text.finished
    states, stopped = processor.process([SequenceOutput(3, token_ids[1:], FinishReason.LENGTH, [entry] * (len(token_ids) - 1))])
    assert stopped == [] and state.finish_reason == "length" and state.text.finished and state.text.text == "Hello there"
    assert len(state.logprobs) == len(token_ids)
    assert processor.process([SequenceOutput(3, [5], None)]) == ([], [])  # finished: forgotten


def test_a_step_that_raises_after_reading_tokens_back_hands_them_out_at_the_next(tiny_model_factory, monkeypatch):
    """A launch that fails (a stage error the engine recovered from) raises past the step's return:
    the deltas it had already taken from the ring come with the next step, none lost."""
    from graphrt import LLM
    from graphrt.errors import StageError

    llm = LLM(tiny_model_factory(), dtype="float32", kv_cache_tokens=256)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = llm.generate([[5, 9, 2]], params)[0].token_ids
    seq = engine.add_request([5, 9, 2], params)
    update, launch, failed, just_read = engine._update, engine._launch_next, [], []

    def reading(mb):
        outputs = update(mb)
        just_read.append(bool(outputs))
        return outputs

    def fail_once_right_after_a_read():
        if just_read and just_read[-1] and not failed:  # this step has read a token back
            failed.append(len(seq.output_ids))
            raise StageError("a stage failed (test)")
        just_read.clear()
        return launch()

    poll = engine._poll
    monkeypatch.setattr(engine, "_poll", lambda block: poll(block=engine.ring.busy))  # a step starts with one back
    monkeypatch.setattr(engine, "_update", reading)
    monkeypatch.setattr(engine, "_launch_next", fail_once_right_after_a_read)
    delivered = []
    while engine.has_work():
        try:
            delivered += [token for output in engine.step() for token in output.new_token_ids]
        except StageError:
            pass
    assert failed and delivered == seq.output_ids == expected
