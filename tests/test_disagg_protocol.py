"""The internal protocol's messages, and the engine types they carry, survive a JSON round trip
unchanged; the JSON is derived from the dataclasses' fields (disagg/dataclass_json.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepserve.disagg import protocol as P
from deepserve.disagg.dataclass_json import from_json, to_json
from deepserve.engine.admission import EngineLimits
from deepserve.engine.contract import ModelCard, ModelInfo
from deepserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from deepserve.engine.sampling_params import SamplingParams, StructuredOutput


def through_json(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_sampling_params_round_trip_through_json():
    params = SamplingParams(
        temperature=0.7,
        seed=42,
        max_tokens=9,
        stop_token_ids=(5, 6),
        logit_bias={3: -1.5},
        logprobs=2,
        structured=StructuredOutput("regex", "[ab]+"),
        cache_salt="tenant",
    )
    wire = through_json(to_json(params))
    assert wire["logit_bias"] == {"3": -1.5} and wire["structured"]["kind"] == "regex"
    assert from_json(SamplingParams, wire) == params


def test_every_sampling_field_travels():
    """A field added to SamplingParams reaches the worker with no line written for it."""
    defaults, changed = SamplingParams(), SamplingParams(top_k=7, min_tokens=3, ignore_eos=True)
    wire = through_json(to_json(changed))
    assert set(wire) == set(vars(defaults))
    assert from_json(SamplingParams, wire) == changed


def test_unknown_keys_are_ignored_and_missing_ones_take_the_default():
    params = from_json(SamplingParams, {"max_tokens": 3, "from_a_newer_router": 1})
    assert params == SamplingParams(max_tokens=3)


@pytest.mark.parametrize("bad", [[1, 2], "x", 3])
def test_a_message_that_is_not_an_object_is_a_type_error(bad):
    with pytest.raises(TypeError):
        from_json(SamplingParams, bad)
    with pytest.raises(TypeError):
        from_json(SamplingParams, {"structured": bad})


def test_request_output_round_trips_through_a_stream_event():
    out = RequestOutput(
        "r",
        [
            CompletionOutput(
                0,
                [7, 8],
                [TokenLogprob(7, -0.5, [(7, -0.5), (9, -1.0)]), TokenLogprob(8, -0.25)],
                "stop",
                8,
            )
        ],
        prompt_tokens=30,
        cached_tokens=16,
        cached_tokens_by_tier={"store": 16},
        finished=True,
    )
    wire = json.loads(json.dumps(P.StreamEvent.from_output(out, ["k1"]).to_json()))
    event = P.StreamEvent.from_json(wire)
    assert event.kv_keys == ["k1"] and event.to_output() == out


def test_router_and_disagg_never_import_torch():
    code = (
        "import sys, deepserve.router.router, deepserve.disagg.flow, deepserve.router.remote_engine;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_model_card_round_trips_with_its_nested_info_and_limits():
    info = ModelInfo("m", "llama", "LlamaForCausalLM", "/p", 100, 64, [2, 3], 1, None, "ab", 0)
    card = ModelCard(info, EngineLimits(100, 64, 256, 8), True, 16, 4096, "native")
    assert from_json(ModelCard, through_json(to_json(card))) == card


def test_event_batch_round_trips_with_its_block_events():
    batch = P.EventBatch(
        "w1", [P.BlockEvent("stored", "k2", "k1", [1, 2]), P.BlockEvent("removed", "k0")]
    )
    assert P.EventBatch.from_json(through_json(batch.to_json())) == batch
