"""Structured outputs: compile output constraints to xgrammar grammars and mask logits with them.

Lives here: `GrammarCache` (tokenizer info + a byte-bounded xgrammar compile cache),
`CompiledGrammar`, the per-sequence `GrammarMatcherState`, and the batch bitmask helpers
`allocate_bitmask` / `apply_bitmask` the sampler uses. Not here: deciding which requests are
constrained (the scheduler), sampling itself (the sampler), protocol parsing (server/).

The bitmask is int32 `[batch, ceil(vocab_size / 32)]`, bit `t % 32` of word `t // 32` set when
token `t` is allowed; `vocab_size` is the model's logits width, which may exceed the tokenizer's
vocabulary (those padding ids are never allowed under a grammar).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.sampling_params import StructuredOutput
from deepserve.engine.xgrammar_import import xgrammar as xgr

# An unbounded compile cache grows with every distinct schema a client sends (CVE-2025-32381).
DEFAULT_CACHE_BYTES = 64 * 2**20
_ANY_OBJECT = '{"type": "object"}'
# xgrammar's native errors start with a log prefix, "[12:34:56] /project/cpp/file.cc:820: ":
# a time of day and a source path of its build, neither of them about the client's constraint.
_NATIVE_PREFIX = re.compile(
    r"(?:\[\d\d:\d\d:\d\d\]\s*)?(?:[\w.\-]*/)+[\w.\-]+\.(?:cc|cpp|h|hpp|py):\d+:\s*"
)
_EOS_SPELLINGS = ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>", "<|eot_id|>")


@dataclass(frozen=True)
class CompiledGrammar:
    grammar: xgr.CompiledGrammar
    kind: str
    compile_seconds: float  # 0.0 when served from the cache's memo of this exact constraint


def tokenizer_info(
    tokenizer, vocab_size: int, stop_token_ids: Sequence[int] | None = None
) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizers.Tokenizer`: vocab strings, encoding type, stop ids."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    detected = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if detected is not None:
        metadata["vocab_type"] = detected
    stops = list(stop_token_ids) if stop_token_ids else _default_stop_ids(vocab)
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=metadata["add_prefix_space"],
    )


def _default_stop_ids(vocab: dict[str, int]) -> list[int]:
    for spelling in _EOS_SPELLINGS:
        if spelling in vocab:
            return [vocab[spelling]]
    raise InvalidRequestError("cannot tell the tokenizer's EOS token; pass stop_token_ids")


class GrammarCache:
    """Compiles `StructuredOutput`s for one tokenizer; xgrammar's cache is bounded in bytes."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        cache_limit_bytes: int = DEFAULT_CACHE_BYTES,
        max_threads: int = 1,
    ) -> None:
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=max_threads, cache_limit_bytes=cache_limit_bytes
        )

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.info.stop_token_ids)

    def cache_bytes(self) -> int:
        return self._compiler.get_cache_size_bytes()

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """Compile (or fetch from cache); InvalidRequestError for a bad schema or grammar."""
        start = time.perf_counter()
        try:
            grammar = self._compile(structured)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            # xgrammar reports bad input as RuntimeError/ValueError (or subclasses of them).
            raise constraint_error(structured.kind, e) from e
        return CompiledGrammar(grammar, structured.kind, time.perf_counter() - start)

    def _compile(self, s: StructuredOutput) -> xgr.CompiledGrammar:
        if s.kind == "json_object":
            # OpenAI's json_object is an object: the builtin JSON grammar with an object root.
            return self._compiler.compile_json_schema(
                _ANY_OBJECT, any_whitespace=True, strict_mode=False
            )
        if s.kind == "json_schema":
            _check_json(s.spec, "json_schema")
            # Compact JSON: free whitespace lets a small model loop on blanks until max_tokens.
            return self._compiler.compile_json_schema(
                s.spec, any_whitespace=False, strict_mode=True
            )
        if s.kind == "regex":
            return self._compiler.compile_regex(s.spec)
        if s.kind == "ebnf":
            return self._compiler.compile_grammar(s.spec)
        if s.kind == "structural_tag":
            _check_json(s.spec, "structural_tag")
            return self._compiler.compile_structural_tag(s.spec)
        if s.kind == "dsml_tool_calls":
            return self._compiler.compile_structural_tag(dsml_structural_tag(s.spec))
        if s.kind == "after_reasoning":
            return self._compiler.compile_structural_tag(after_reasoning_tag(s.spec))
        raise InvalidRequestError(f"unknown structured output kind {s.kind!r}")


def _check_json(text: str, what: str) -> None:
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{what} is not valid JSON: {e}") from e


class GrammarMatcherState:
    """One sequence's position in its grammar. Call order per step: fill_bitmask, then accept."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self.kind = compiled.kind

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 tensor)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once the grammar has accepted its stop token: the sequence must end."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the output so far is a complete match (a stop token would be accepted)."""
        return self._matcher.is_completed()


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask `[batch, ceil(vocab_size / 32)]` (unconstrained rows stay -1)."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set disallowed logits to -inf in place, for all rows or only `rows` (a LongTensor).

    `logits` is `[B, V_logits]` and `bitmask` `[B, W]`; ids at or past `W * 32` are disallowed,
    mask bits past `V_logits` are ignored. One vectorized op per call, no per-request Python.
    """
    mask = bitmask.to(logits.device, non_blocking=True)
    target = logits if rows is None else logits[rows]
    if rows is not None:
        mask = mask[rows.to(mask.device)]
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    width = target.shape[-1]
    if allowed.shape[1] < width:
        pad = allowed.new_zeros(allowed.shape[0], width - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    masked = target.masked_fill(~allowed[:, :width], float("-inf"))
    if rows is None:
        logits.copy_(masked)
    else:
        logits[rows] = masked


def dsml_structural_tag(spec: str, max_whitespace: int = 4) -> str:
    """The xgrammar structural tag for a "dsml_tool_calls" constraint (DeepSeek DSML tool calls),
    arguments held to each tool's parameters.

    spec: JSON with "format" (xgrammar's builtin name, "deepseek_v4" or "deepseek_v4_1"), "tools"
    (a JSON array of Chat Completions function tools, parameters as the client sent them),
    "required", "parallel", "opened_in_prompt" (the prompt already ends with the tool-calls opener,
    tool_choice "required": the grammar starts after it) and "reasoning" (the output starts inside
    the model's reasoning, which stays free until `</think>`). Whitespace runs between parameters
    are bounded: unbounded ones let a model loop on blanks. Built here, not by the server, because
    xgrammar loads torch and the frontend process never does.
    """
    try:
        d = json.loads(spec)
        tag = xgr.get_builtin_structural_tag(
            d["format"],
            tools=json.loads(d["tools"]),
            tool_choice="required" if d["required"] else "auto",
            reasoning=d.get("reasoning", False),
            parallel_tool_calls=d.get("parallel", True),
            max_whitespace_cnt=max_whitespace,
        )
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidRequestError(f"tools cannot be turned into a grammar: {e}") from e
    tag_spec = json.loads(tag.model_dump_json())
    if d.get("opened_in_prompt"):
        tag_spec["format"] = _after_opener(tag_spec["format"])
    return json.dumps(tag_spec)


def _after_opener(fmt: dict) -> dict:
    """Drop the leading constant opener of a sequence format (the prompt already holds it)."""
    elements = fmt.get("elements", []) if fmt.get("type") == "sequence" else []
    if elements and elements[0].get("type") == "const_string":
        rest = elements[1:]
        return rest[0] if len(rest) == 1 else {**fmt, "elements": rest}
    return fmt


def after_reasoning_tag(spec: str) -> str:
    """The structural tag of an "after_reasoning" constraint: its inner constraint applied once
    the reasoning ends, as vLLM does for reasoning models.

    spec: JSON with "kind" and "spec" (the inner StructuredOutput), "end" (the token that ends the
    reasoning) and "exclude" (the reasoning markers). The reasoning is any tokens but the markers,
    up to the end token itself (the token, not its spelling in plain tokens, since the output
    parser also splits on the token); the answer after it is held to the inner constraint, with
    the grammar it would get alone. A tool-call constraint handles reasoning itself
    (dsml_structural_tag).
    """
    try:
        d = json.loads(spec)
        inner = StructuredOutput(d["kind"], d.get("spec", ""))
        end, exclude = d["end"], list(d["exclude"])
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidRequestError(f"invalid after_reasoning constraint: {e}") from e
    answer = {"type": "grammar", "grammar": str(_answer_grammar(inner))}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "any_tokens", "exclude_tokens": exclude},
                {"type": "token", "token": end},
                answer,
            ],
        },
    }
    return json.dumps(tag)


def _answer_grammar(s: StructuredOutput) -> xgr.Grammar:
    """The grammar GrammarCache compiles for `s` alone, as an xgrammar Grammar."""
    try:
        if s.kind == "json_object":
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=True, strict_mode=False)
        if s.kind == "json_schema":
            _check_json(s.spec, "json_schema")
            return xgr.Grammar.from_json_schema(s.spec, any_whitespace=False, strict_mode=True)
        if s.kind == "regex":
            return xgr.Grammar.from_regex(s.spec)
        if s.kind == "ebnf":
            return xgr.Grammar.from_ebnf(s.spec)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise constraint_error(s.kind, e) from e
    raise InvalidRequestError(f"a {s.kind} constraint cannot follow the reasoning")


def constraint_error(kind: str, e: Exception) -> InvalidRequestError:
    """The 400 for a constraint xgrammar refused: its message, without the log prefix and source
    paths of xgrammar's build (the client learns what is wrong, not where the parser lives)."""
    message = _NATIVE_PREFIX.sub("", str(e)).strip()
    return InvalidRequestError(f"invalid {kind} constraint: {message}")
