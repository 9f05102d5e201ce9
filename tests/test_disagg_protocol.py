"""The internal protocol's messages survive a JSON round trip unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

from deepserve.disagg import protocol as P
from deepserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from deepserve.engine.sampling_params import SamplingParams, StructuredOutput


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
    wire = json.loads(json.dumps(P.sampling_to_dict(params)))
    assert P.sampling_from_dict(wire) == params


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
        "import sys, deepserve.router.router, deepserve.router.flow, deepserve.router.remote_engine;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
