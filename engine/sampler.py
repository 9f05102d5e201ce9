"""Choosing the next token for every sampled row of a step, vectorized over the batch.

`SamplingBatch.build(...)` turns the sequences being sampled into tensors once per step;
`Sampler.sample(logits, batch)` applies, in order: penalties (repetition, presence, frequency),
logit_bias, token suppression (min_tokens), the structured-output bitmask, then greedy argmax or
temperature + top_k / top_p / min_p filtering + Gumbel-max with hashed noise (kernels/random.py),
so a row's randomness depends only on (its seed, its output position, token id). Logprobs are the
raw model's (log_softmax of the unprocessed logits). `Sampler.sample_on_device` does the same
without waiting: the ids stay on the device for a next step to read, their host copies are read by
`DeviceSample.result()` (async scheduling). Stop conditions live in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.engine.outputs import TokenLogprob
from deepserve.engine.request import Sequence
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.random import as_int64, gumbel_noise, token_keys
from deepserve.kernels.registry import get_kernels

Tensor = torch.Tensor


@dataclass
class Penalties:
    presence: Tensor  # [N, 1]
    frequency: Tensor  # [N, 1]
    repetition: Tensor  # [N, 1]
    output_counts: Tensor  # [N, V] float32: occurrences of each token in the output so far
    prompt_mask: Tensor  # [N, V] bool: token occurs in the prompt


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one step. Optional parts are None when no row uses them."""

    num_rows: int
    all_greedy: bool
    # None when every row is greedy: argmax needs none of them, and a GPU step then copies
    # nothing to the device for sampling.
    greedy: Tensor | None  # [N] bool
    temperature: Tensor | None  # [N, 1] float32 (1.0 on greedy rows)
    seeds: Tensor | None  # [N] int64
    positions: Tensor | None  # [N] int64: output position of the token being sampled
    top_k: Tensor | None  # [N] int64, V where disabled
    top_p: Tensor | None  # [N, 1] float32
    min_p: Tensor | None  # [N, 1] float32
    penalties: Penalties | None
    bias: tuple[Tensor, Tensor, Tensor] | None  # (rows, token ids, values)
    suppress: tuple[Tensor, Tensor] | None  # (rows, token ids) forced to -inf
    bitmask: Tensor | None  # [N, ceil(V/32)] int32, filled by the grammar matchers
    max_logprobs: int  # -1: no row wants logprobs
    logprob_rows: list[int]  # rows whose caller asked for logprobs
    logprob_k: list[int]  # top-k count asked for, per entry of logprob_rows

    @staticmethod
    def build(
        seqs: list[Sequence], eos_ids: tuple[int, ...], vocab_size: int, device: torch.device
    ) -> SamplingBatch:
        n = len(seqs)
        params = [s.params for s in seqs]
        greedy_list = [p.greedy for p in params]
        all_greedy = all(greedy_list)

        def col(values: list, dtype: torch.dtype) -> Tensor:
            return to_device(values, dtype, device)

        top_k = top_p = min_p = None
        greedy = temperature = seeds = positions = None
        if not all_greedy:
            temps = [1.0 if g else p.temperature for g, p in zip(greedy_list, params, strict=True)]
            greedy = col(greedy_list, torch.bool)
            temperature = col(temps, torch.float32)[:, None]
            seeds = col([as_int64(s.seed) for s in seqs], torch.int64)
            positions = col([s.num_output_tokens for s in seqs], torch.int64)
            if any(p.top_k > 0 for p in params):
                # Clamped as vLLM does: any k past the vocabulary keeps every token, and a
                # client's k need not fit an int64.
                ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
                top_k = col(ks, torch.int64)
            if any(p.top_p < 1.0 for p in params):
                top_p = col([p.top_p for p in params], torch.float32)[:, None]
            if any(p.min_p > 0.0 for p in params):
                min_p = col([p.min_p for p in params], torch.float32)[:, None]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return SamplingBatch(
            num_rows=n,
            all_greedy=all_greedy,
            greedy=greedy,
            temperature=temperature,
            seeds=seeds,
            positions=positions,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            penalties=_build_penalties(seqs, vocab_size, device),
            bias=_build_bias(seqs, device),
            suppress=_build_suppress(seqs, eos_ids, device),
            bitmask=None,
            max_logprobs=max((params[i].logprobs for i in logprob_rows), default=-1),
            logprob_rows=logprob_rows,
            logprob_k=[params[i].logprobs for i in logprob_rows],
        )


def _build_penalties(
    seqs: list[Sequence], vocab_size: int, device: torch.device
) -> Penalties | None:
    params = [s.params for s in seqs]
    if all(
        p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1
        for p in params
    ):
        return None
    n = len(seqs)
    out_rows, out_toks, prompt_rows, prompt_toks = [], [], [], []
    for i, s in enumerate(seqs):
        out = s.output_token_ids
        out_rows += [i] * len(out)
        out_toks += out
        if s.params.repetition_penalty != 1:
            prompt_rows += [i] * s.num_prompt_tokens
            prompt_toks += s.token_ids[: s.num_prompt_tokens]
    counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
    if out_toks:
        idx = (to_device(out_rows, None, device), to_device(out_toks, None, device))
        counts.index_put_(idx, torch.ones(len(out_toks), device=device), accumulate=True)
    prompt_mask = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
    if prompt_toks:
        prompt_mask[torch.tensor(prompt_rows), torch.tensor(prompt_toks)] = True

    def col(values: list[float]) -> Tensor:
        return to_device(values, torch.float32, device)[:, None]

    return Penalties(
        presence=col([p.presence_penalty for p in params]),
        frequency=col([p.frequency_penalty for p in params]),
        repetition=col([p.repetition_penalty for p in params]),
        output_counts=counts,
        prompt_mask=prompt_mask,
    )


def _build_bias(seqs: list[Sequence], device: torch.device) -> tuple[Tensor, Tensor, Tensor] | None:
    rows, toks, vals = [], [], []
    for i, s in enumerate(seqs):
        for tok, val in (s.params.logit_bias or {}).items():
            rows.append(i)
            toks.append(int(tok))
            vals.append(float(val))
    if not rows:
        return None
    return (
        to_device(rows, None, device),
        to_device(toks, None, device),
        to_device(vals, torch.float32, device),
    )


def _build_suppress(
    seqs: list[Sequence], eos_ids: tuple[int, ...], device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """Stop and EOS tokens are banned while a row has fewer than min_tokens outputs."""
    rows, toks = [], []
    for i, s in enumerate(seqs):
        p = s.params
        if s.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            rows += [i] * len(banned)
            toks += sorted(banned)
    if not rows:
        return None
    return to_device(rows, None, device), to_device(toks, None, device)


def to_device(values: list, dtype: torch.dtype | None, device: torch.device) -> Tensor:
    """A host list as a tensor on `device` (`dtype` None: torch's inference, so a bad value such
    as a float token id still fails where it is used). On a GPU through pinned memory and a
    non-blocking copy: a copy from pageable memory waits for the whole queue, and these are built every step
    (the caching host allocator keeps the pinned buffer until its copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the caller did not ask


@dataclass
class DeviceSample:
    """A step's samples still on the device: the ids a next step can read there (async
    scheduling feeds them to its graph without a host round trip), and their copies to the host,
    queued behind them. `result()` waits for those copies only, never for later work on the
    stream, so a step queued after this one keeps the GPU busy while the host applies these."""

    token_ids: Tensor  # [N] int64 on the logits' device
    batch: SamplingBatch
    host_ids: Tensor  # the copies to the host (pinned, non-blocking on a GPU)
    host_chosen: Tensor | None  # [len(logprob_rows)] log-probability of each sampled token
    host_top: tuple[Tensor, Tensor] | None  # (values, ids) [len(logprob_rows), max_logprobs]
    copied: torch.cuda.Event | None  # recorded after the copies; None off the GPU

    def result(self) -> SamplerOutput:
        if self.copied is not None:
            self.copied.synchronize()
        token_list = self.host_ids.tolist()
        return SamplerOutput(token_list, self._logprobs(token_list))

    def _logprobs(self, token_list: list[int]) -> list[TokenLogprob | None]:
        batch = self.batch
        out: list[TokenLogprob | None] = [None] * batch.num_rows
        if self.host_chosen is None:
            return out
        chosen = self.host_chosen.tolist()
        top_vals = top_ids = None
        if self.host_top is not None:
            top_vals, top_ids = self.host_top[0].tolist(), self.host_top[1].tolist()
        for j, row in enumerate(batch.logprob_rows):
            k = batch.logprob_k[j]
            top_pairs = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True)) if k else []
            out[row] = TokenLogprob(token_list[row], chosen[j], top_pairs)
        return out


class Sampler:
    """Stateless apart from a cached per-token hash table. Its argmax comes from `kernels`
    (by default the device's default KernelSet: every set's argmax picks the same ids)."""

    def __init__(
        self, vocab_size: int, device: torch.device, kernels: KernelSet | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._token_keys = token_keys(vocab_size, device)
        self._argmax = (kernels or get_kernels(device, batch_invariant=False)).argmax

    def sample(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, V] float32 (may be padded past the vocabulary; extra columns are dropped)."""
        return self.sample_on_device(logits, batch).result()

    def sample_on_device(self, logits: Tensor, batch: SamplingBatch) -> DeviceSample:
        """Queue the sampling and the copies of its results to the host; wait for nothing."""
        logits = logits[:, : self.vocab_size].float()
        raw = logits
        logits = self._process(logits, batch)
        tokens = self._argmax(logits)
        if not batch.all_greedy:
            sampled = self._sample_random(logits, batch)
            tokens = torch.where(batch.greedy, tokens, sampled)
        chosen = top = None
        if batch.max_logprobs >= 0:
            chosen, top = self._logprobs(raw, tokens, batch)
        copied = None
        host = tokens.to("cpu", non_blocking=True)  # into pinned memory from a GPU
        if chosen is not None:
            chosen = chosen.to("cpu", non_blocking=True)
        if top is not None:
            top = (top[0].to("cpu", non_blocking=True), top[1].to("cpu", non_blocking=True))
        if tokens.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return DeviceSample(tokens, batch, host, chosen, top, copied)

    def _process(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        parts = (batch.penalties, batch.bias, batch.suppress, batch.bitmask)
        if all(part is None for part in parts):
            return logits
        logits = logits.clone()
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.bias is not None:
            rows, toks, vals = batch.bias
            logits.index_put_((rows, toks), vals, accumulate=True)
        if batch.suppress is not None:
            logits[batch.suppress] = float("-inf")
        if batch.bitmask is not None:
            from deepserve.engine.structured import apply_bitmask

            apply_bitmask(logits, batch.bitmask)
        return logits

    def _sample_random(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        scaled = logits / batch.temperature
        scaled = apply_filters(scaled, batch.top_k, batch.top_p, batch.min_p)
        noise = gumbel_noise(batch.seeds, batch.positions, self._token_keys)
        return self._argmax(scaled + noise)

    def _logprobs(
        self, raw: Tensor, tokens: Tensor, batch: SamplingBatch
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """The raw model's log-probability of each sampled token, and the top ones, on the
        device, for the rows that asked."""
        rows = to_device(batch.logprob_rows, None, raw.device)
        logprobs = torch.log_softmax(raw[rows], dim=-1)
        chosen = logprobs.gather(1, tokens[rows][:, None])[:, 0]
        if batch.max_logprobs == 0:
            return chosen, None
        top = logprobs.topk(batch.max_logprobs, dim=-1)
        return chosen, (top.values, top.indices)


def apply_penalties(logits: Tensor, p: Penalties) -> Tensor:
    """Repetition (prompt + output, divides positive logits), then presence and frequency."""
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
    logits = torch.where(seen, rep, logits)
    logits = logits - p.frequency * p.output_counts
    return logits - p.presence * (p.output_counts > 0).float()


def apply_filters(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, min_p: Tensor | None
) -> Tensor:
    """Set filtered tokens to -inf. top_k then top_p on the sorted row, then min_p."""
    if top_k is not None or top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
            drop |= ranks >= top_k[:, None]
        if top_p is not None:
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            drop |= before >= top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        limit = probs.max(dim=-1, keepdim=True).values * min_p
        logits = logits.masked_fill(probs < limit, float("-inf"))
    return logits
