"""`SamplingParams`: how one request's tokens are chosen and when it stops. Plain data, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from deepserve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutput:
    """An output constraint compiled to an xgrammar grammar by engine/structured.py.

    kind: "json_schema" (spec = schema as JSON text), "json_object" (spec ignored), "regex",
    "ebnf" (spec = grammar text), "structural_tag" (spec = xgrammar structural-tag JSON),
    "dsml_tool_calls" (DeepSeek tool calls; spec described at engine/structured.py
    `dsml_structural_tag`) or "after_reasoning" (another constraint applied once the reasoning
    ends; `after_reasoning` below, compiled by `after_reasoning_tag`). The server builds specs
    only as JSON: xgrammar loads torch, which the frontend process never does.
    """

    kind: str
    spec: str = ""


def after_reasoning(
    inner: StructuredOutput, reasoning_end: str, reasoning_tokens: tuple[str, ...]
) -> StructuredOutput:
    """`inner` applied once the model's reasoning ends at the token `reasoning_end`; the
    reasoning before it is free but for the markers `reasoning_tokens`."""
    spec = {
        "kind": inner.kind,
        "spec": inner.spec,
        "end": reasoning_end,
        "exclude": list(reasoning_tokens),
    }
    return StructuredOutput("after_reasoning", json.dumps(spec))


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None  # None: the engine draws a random 64-bit seed
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the top k
    structured: StructuredOutput | None = None
    # Not a sampling choice, but it travels with them to every worker: the prefix-cache
    # namespace (server/cache_salt.py). Requests share cached KV blocks only with equal salts.
    cache_salt: str | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        checks = [
            (self.n >= 1, "n must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
        bad += [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (size {vocab_size})"
            )
