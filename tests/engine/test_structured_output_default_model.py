"""The default model under seeded random JSON schemas (graphrt.tools.schemas): every output parses and
validates with the `jsonschema` package. All 50 greedy, one stage with async scheduling; 8 of them
sampled on two stages without it (benchmarks/structured_bench.py --validate runs every combination).
Streamed responses are the server's (tests/server)."""

from __future__ import annotations

import json
import random

import pytest

from graphrt import LLM, SamplingParams
from graphrt.sampling_params import StructuredOutput
from graphrt.tools.schemas import random_schema, schema_prompt

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.slow

NUM_SCHEMAS = 50
SCHEMAS = [random_schema(random.Random(seed)) for seed in range(NUM_SCHEMAS)]


def validate_all(llm: LLM, schemas: list[dict], temperature: float) -> None:
    prompts = [llm.chat_prompt(schema_prompt(schema, index)) for index, schema in enumerate(schemas)]
    params = [
        SamplingParams(max_tokens=256, temperature=temperature, seed=index, structured_output=StructuredOutput(json=schema))
        for index, schema in enumerate(schemas)
    ]
    for schema, out in zip(schemas, llm.generate(prompts, params)):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_fifty_random_schemas_greedy_one_stage_async(default_model):
    llm = LLM(model=default_model, dtype="float32", max_num_seqs=32, pp=1, async_scheduling=True)
    validate_all(llm, SCHEMAS, temperature=0.0)
    assert llm.engine.grammars.num_constrained == NUM_SCHEMAS
    llm.engine.close()


def test_random_schemas_sampled_two_stages_without_async(default_model):
    llm = LLM(model=default_model, dtype="float32", max_num_seqs=8, pp=2, async_scheduling=False)
    validate_all(llm, SCHEMAS[:8], temperature=1.0)
    llm.engine.close()
