"""Admission: the one check a request passes before any work is queued, and its result.

`check_request(limits, prompt, params, resume)` validates token ids and sampling parameters
against an engine's `EngineLimits` and resolves max_tokens; every engine client (the in-process
`AsyncEngine`, the frontend's `RemoteEngine`, the offline `LLM`) calls this same function, so a
bad request gets the same error whichever topology serves it. What passes becomes an
`AdmittedRequest`, which `generate` trusts. Torch-free: the frontend imports it.

Not here: mapping a protocol body to `SamplingParams` (server/admission.py) and compiling the
output constraint (engine/structured.py, called by the in-process engine's `admit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    """What admission needs to know of an engine: part of its model card."""

    vocab_size: int
    max_model_len: int
    kv_pool_tokens: int  # device KV blocks x block size: one request's prompt + output must fit
    max_num_seqs: int


@dataclass(frozen=True)
class AdmittedRequest:
    """A request that passed admission. `params` are as sent (max_tokens may be None, "up to the
    context"); `max_tokens` is the resolved budget. `grammar` is the compiled output constraint
    where the engine runs in this process (None otherwise, or without a constraint)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    resume_token_ids: list[int] = field(default_factory=list)
    grammar: object | None = None


def check_request(
    limits: EngineLimits,
    prompt_token_ids: list[int],
    params: SamplingParams,
    resume_token_ids=(),
) -> int:
    """Validate a request; return its resolved max_tokens. Raises InvalidRequestError."""
    n_prompt = len(prompt_token_ids)
    if n_prompt == 0:
        raise InvalidRequestError("the prompt is empty")
    vocab = limits.vocab_size
    bad = [t for t in [*prompt_token_ids, *resume_token_ids] if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
    params.validate(vocab)
    if resume_token_ids:
        _check_resume(limits, n_prompt, params, len(resume_token_ids))
    if n_prompt >= limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n_prompt} tokens; the context limit is {limits.max_model_len} "
            "and at least one token must be generated"
        )
    max_tokens = _resolve_max_tokens(limits, n_prompt, params.max_tokens)
    if params.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens {params.min_tokens} exceeds max_tokens {max_tokens}")
    if params.n > limits.max_num_seqs:
        raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs {limits.max_num_seqs}")
    return max_tokens


def _check_resume(
    limits: EngineLimits, n_prompt: int, params: SamplingParams, n_resume: int
) -> None:
    if params.n != 1:
        raise InvalidRequestError("only a single-sample request (n=1) can be resumed")
    if params.max_tokens is not None and n_resume >= params.max_tokens:
        raise InvalidRequestError(
            f"{n_resume} resumed tokens leave nothing of max_tokens {params.max_tokens}"
        )
    if n_prompt + n_resume >= limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt and resumed tokens ({n_prompt + n_resume}) leave no room in the "
            f"context limit {limits.max_model_len}"
        )


def _resolve_max_tokens(limits: EngineLimits, n_prompt: int, requested: int | None) -> int:
    room = limits.max_model_len - n_prompt
    pool = limits.kv_pool_tokens
    if n_prompt >= pool:  # checked before any budget: unset max_tokens would resolve to <= 0
        raise InvalidRequestError(
            f"the prompt has {n_prompt} tokens; the KV pool holds {pool} tokens and at least "
            "one token must be generated"
        )
    if requested is None:
        requested = min(room, pool - n_prompt)
    elif requested > room:
        raise InvalidRequestError(
            f"max_tokens {requested} plus the prompt's {n_prompt} tokens exceeds the "
            f"context limit {limits.max_model_len}"
        )
    if n_prompt + requested > pool:
        raise InvalidRequestError(
            f"the prompt ({n_prompt}) plus max_tokens ({requested}) does not fit the KV pool "
            f"of {pool} tokens"
        )
    return requested
