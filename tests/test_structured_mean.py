"""The mean structured-output test: prompts ask for free prose and say not to output JSON; the
schema forces JSON anyway. Each answer must end with finish_reason "stop", validate against the
schema (jsonschema, not our code), and its last generated token must be EOS.

The schema bounds its strings with maxLength, as a user would: a 135M model can otherwise ramble
inside one string until max_tokens.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from openai import OpenAI
from server_harness import server, smollm_engine

from deepserve.engine.sampling_params import SamplingParams, StructuredOutput

MODEL = "smollm2-135m"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "lines": {
            "type": "array",
            "items": {"type": "string", "maxLength": 60},
            "minItems": 1,
            "maxItems": 3,
        },
        "mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
    },
    "required": ["title", "lines", "mood"],
    "additionalProperties": False,
}
PROMPTS = [
    "Write a short poem about the sea. Do not output JSON or code, only plain verse.",
    "Tell me a two-sentence story about a fox. Never use JSON.",
]
FORMAT = {"type": "json_schema", "json_schema": {"name": "poem", "schema": SCHEMA, "strict": True}}

__all__ = ["server", "smollm_engine"]  # shared fixtures (server_harness)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prose_prompt_still_yields_schema_valid_json(server, prompt):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=300,
        response_format=FORMAT,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_constrained_generation_ends_with_eos(server):
    """Below the protocol: the engine's last token for the same request is the model's EOS."""
    engine = server.engine
    family = server.app.state.deepserve.family
    text = family.template.render(
        messages=[{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True
    )
    prompt = engine.tokenizer.encode(text, add_special_tokens=False).ids
    params = SamplingParams(
        temperature=0.7,
        seed=11,
        max_tokens=300,
        structured=StructuredOutput("json_schema", json.dumps(SCHEMA)),
    )

    async def run() -> tuple[list[int], str]:
        ids, reason = [], None
        async for out in engine.generate("mean-eos", engine.admit(prompt, params)):
            ids += out.outputs[0].token_ids
            reason = out.outputs[0].finish_reason or reason
        return ids, reason

    ids, reason = asyncio.run(run())
    assert reason == "stop"
    assert ids[-1] in engine.model_info.eos_token_ids
    jsonschema.validate(json.loads(engine.tokenizer.decode(ids[:-1])), SCHEMA)
