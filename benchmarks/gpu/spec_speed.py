"""Speculative decoding against plain decoding on the GPU, in one process (issue 34).

Per shape (SmolLM2-135M and DeepSeek-V2-Lite, bf16, transformers' random init as speed.py builds
them; V2-Lite's made to repeat its last token, `repeat_last_token`), on repetitive prompts whose continuation repeats them, the case n-gram drafting is for
(a rewrite or code edit: here a random 32-token start followed by the model's own 64-token greedy
continuation; random weights fall into runs of one token, which the continuation keeps
repeating. A span said four times, the earlier workload, is not continued by random weights, so
its drafts measured the throttle's back-off rather than verification): decode
tokens/s of plain decoding (async scheduling on, the default, and off: a speculative step
runs ahead only while every sequence's drafting is paused) and of n-gram speculation (k = 3) at
batch 1 and 8, with the drafts made and accepted; the same speculative engine with a drafter that proposes plain decoding's own
continuation (`oracle`: every draft accepted, what verification costs at full acceptance); and
whether greedy output equals plain decoding's at batch 1 and 8: in bf16 (default kernels, where
rows may differ in the last bit, so informative only), in bf16 under `--batch-invariant` (must
be equal) and, for SmolLM2, in float32. Then tiny-deepseek (vocabulary 129,280) with MTP and
random MTP weights (nearly no draft accepted: the draft throttle's case) against plain, with
the throttle on and off.

Section `spec_mtp` (`section_spec_mtp`, issue 34's random-MTP row alone, ~3 minutes): plain
against MTP on tiny-deepseek and on the V2-Lite geometry with one random MTP layer, batch 1 and
8, their ratio, and where the MTP run's time goes (`mtp_breakdown`).

Decode tokens/s: prefix caching off, generate(prompts, 1 token) timed apart and taken out of
generate(prompts, N + 1 tokens), best of two. Imported by run_all.py (section `spec_speed`).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

TOKENS = 96
# Section spec_mtp: tiny-deepseek's 96-token run lasted ~30 ms, and runs of one engine swung
# 0.8-1.7x between minutes of one call (run-gpu16): longer runs, more alternations, and MTP's
# probes (one every MAX_PAUSE steps when cold) inside the timed run.
MTP_TOKENS = 480
MTP_ROUNDS = 5  # alternations of plain and MTP per batch
BATCHES = (1, 8)
K = 3


def _sync() -> None:
    torch.cuda.synchronize()


def _greedy(n: int):
    from deepserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


# prompts(seed, batch) -> `batch` prompts
PromptSource = Callable[[int, int], list[list[int]]]
SEED_OFFSETS = (99, 0, 1)  # decode_run's warm-up and its two timed runs


def repetitive_prompts(seed: int, batch: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(16)] * 4 for _ in range(batch)]


def self_repeating_prompts(llm, vocab: int) -> PromptSource:
    """Every prompt set decode_run asks for at BATCHES: a random 32-token start and the plain
    engine's own 64-token greedy continuation of it, made once so every engine gets the same."""
    table = {}
    for batch in BATCHES:
        for offset in SEED_OFFSETS:
            seed = 10 * batch + offset
            rng = random.Random(seed)
            starts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(batch)]
            outputs = llm.generate(starts, _greedy(64))
            table[seed, batch] = [s + r.token_ids for s, r in zip(starts, outputs, strict=True)]
    return lambda seed, batch: table[seed, batch]


def repeat_last_token(weights: dict[str, torch.Tensor]) -> None:
    """Random V2-Lite weights whose greedy continuation repeats its last token, as SmolLM2's random
    init does by itself (transformers' V2-Lite init continues with tokens that never repeat, so
    n-gram lookup found nothing to draft): the blocks' writes to the residual stream (o_proj,
    every down_proj) scaled by 1/100 and the output head tied to the embedding, so the last hidden
    state is nearly the current token's embedding and its own logit wins by a wide margin. Same
    shapes, bytes and kernels per step as the plain random weights; only the values change."""
    for name, tensor in weights.items():
        if name.endswith("o_proj.weight") or "down_proj" in name:
            tensor.mul_(0.01)  # at 1/20, 27 layers drifted to another token after ~20
    weights["lm_head.weight"].copy_(weights["model.embed_tokens.weight"])


class ReferenceDrafter:
    """Proposes the plain engine's own continuation of each known prompt (every draft right)."""

    def __init__(self) -> None:
        self.known: dict[tuple[int, ...], list[int]] = {}

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        for size in {len(p) for p in self.known}:
            output = self.known.get(tuple(token_ids[:size]))
            if output is not None:
                done = len(token_ids) - size
                return output[done : done + num_tokens]
        return []


def _timed(llm, prompts, n: int) -> tuple[float, list[list[int]]]:
    _sync()
    t0 = time.perf_counter()
    results = llm.generate(prompts, _greedy(n))
    _sync()
    return time.perf_counter() - t0, [r.token_ids for r in results]


def decode_run(
    llm,
    prompt_source: PromptSource,
    batch: int,
    seed: int,
    record: dict | None = None,
    tokens: int = TOKENS,
) -> tuple[float, list[list[int]]]:
    """Decode tok/s of `batch` prompts (best of two), and the last run's outputs; `record`:
    filled with prompt -> output of the timed runs."""
    _timed(llm, prompt_source(seed + SEED_OFFSETS[0], batch), 8)  # warm-up
    best, outputs = 0.0, []
    for rep in SEED_OFFSETS[1:]:
        prompts = prompt_source(seed + rep, batch)
        prefill, _ = _timed(llm, prompts, 1)
        total, outputs = _timed(llm, prompts, tokens + 1)
        best = max(best, batch * tokens / max(total - prefill, 1e-9))
        if record is not None:
            record.update((tuple(p), o) for p, o in zip(prompts, outputs, strict=True))
    return best, outputs


def measure(
    rows: list,
    label: dict,
    llm,
    prompt_source: PromptSource,
    deadline: float,
    record: dict | None = None,
) -> dict:
    """tok/s, drafted/accepted and outputs per batch size for one engine; {batch: outputs}."""
    spec = llm.engine.spec
    outputs = {}
    for batch in BATCHES:
        if time.time() > deadline:
            break
        before = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) if spec else None
        tok_s, outputs[batch] = decode_run(llm, prompt_source, batch, 10 * batch, record)
        row = dict(label, batch=batch, decode_tok_s=round(tok_s, 1))
        if spec is not None:
            row["drafted"] = spec.stats.num_draft_tokens - before[0]
            row["accepted"] = spec.stats.num_accepted_tokens - before[1]
        rows.append(row)
        print(row, flush=True)
    return outputs


def equal_rows(rows: list, label: dict, plain: dict, spec: dict) -> None:
    for batch in plain:
        if batch in spec:
            rows.append(dict(label, batch=batch, greedy_equal=plain[batch] == spec[batch]))
            print(rows[-1], flush=True)


def _release(llm) -> None:
    llm.engine.runner.close()
    del llm
    torch.cuda.empty_cache()


def _shape(rows: list, name: str, deadline: float) -> None:
    import speed

    from deepserve.engine.config import SpeculativeConfig

    config = speed.SHAPES[name]
    vocab = config["vocab_size"]
    hf = speed.build_hf(config)
    weights = dict(hf.state_dict())
    if name == "v2-lite":
        repeat_last_token(weights)
    ngram = SpeculativeConfig("ngram", K)

    def build(batch_invariant: bool, dtype: str = "bfloat16", **kw):
        return speed.build_llm_over(
            config, weights, batch_invariant, dtype=dtype, max_num_seqs=8, max_model_len=1024,
            kv_cache_bytes=2**30, enable_prefix_caching=False, **kw,
        )  # fmt: skip

    base = dict(shape=name, dtype="bfloat16", batch_invariant=False)
    oracle = ReferenceDrafter()
    llm = build(False)
    prompts = self_repeating_prompts(llm, vocab)
    plain = measure(rows, dict(base, run="plain"), llm, prompts, deadline, oracle.known)
    _release(llm)
    llm = build(False, async_scheduling=False)
    measure(rows, dict(base, run="plain, async off"), llm, prompts, deadline)
    _release(llm)
    llm = build(False, speculative=ngram)
    spec = measure(rows, dict(base, run="ngram"), llm, prompts, deadline)
    equal_rows(rows, dict(base, run="ngram vs plain"), plain, spec)
    llm.engine.spec.token_proposer = oracle
    measure(rows, dict(base, run="oracle drafts"), llm, prompts, deadline)
    _release(llm)
    checks = [("bfloat16", True)] + ([("float32", False)] if name == "smollm2" else [])
    for dtype, flag in checks:
        if time.time() > deadline:
            break
        label = dict(shape=name, dtype=dtype, batch_invariant=flag)
        oracle = ReferenceDrafter()  # under the flag verification rows are decode's bits
        llm = build(flag, dtype)
        plain = measure(rows, dict(label, run="plain"), llm, prompts, deadline, oracle.known)
        _release(llm)
        llm = build(flag, dtype, speculative=ngram)
        spec = measure(rows, dict(label, run="ngram"), llm, prompts, deadline)
        equal_rows(rows, dict(label, run="ngram vs plain"), plain, spec)
        if flag:
            llm.engine.spec.token_proposer = oracle
            measure(rows, dict(label, run="oracle drafts"), llm, prompts, deadline)
        _release(llm)
    weights.clear()  # the engines are gone; drop transformers' copy too
    del hf
    torch.cuda.empty_cache()


def _mtp(rows: list, deadline: float) -> None:
    import speed

    from deepserve.engine.config import SpeculativeConfig
    from deepserve.engine.testmodels.tiny_deepseek import TINY_CONFIG, _tensors

    config = dict(TINY_CONFIG, vocab_size=129280)
    weights = _tensors(config, torch.Generator().manual_seed(0))
    vocab = config["vocab_size"]
    label = dict(shape="tiny-deepseek", dtype="bfloat16", batch_invariant=False)
    outputs = {}

    def spans(seed: int, batch: int) -> list[list[int]]:
        return repetitive_prompts(seed, batch, vocab)

    for run, kw in (
        ("plain", {}),
        ("plain, async off", dict(async_scheduling=False)),
        ("mtp", dict(speculative=SpeculativeConfig("mtp", K))),
        ("mtp, throttle off", dict(speculative=SpeculativeConfig("mtp", K, adaptive=False))),
    ):
        if time.time() > deadline:
            break
        llm = speed.build_llm_over(
            config, weights, False, max_num_seqs=8, kv_cache_bytes=2**30,
            enable_prefix_caching=False, **kw,
        )  # fmt: skip
        outputs[run] = measure(rows, dict(label, run=run), llm, spans, deadline)
        _release(llm)
    if "mtp" in outputs:
        equal_rows(rows, dict(label, run="mtp vs plain"), outputs["plain"], outputs["mtp"])


def mtp_breakdown(llm, vocab: int, batch: int, tokens: int = TOKENS) -> dict:
    """Where a speculative run's time goes, over one more timed run: MTP forwards
    (each eager), verification rounds with drafts, host wall time inside `propose` (MTP forwards
    and the drafts' device-to-host copy), steps run ahead and synchronous fallbacks."""
    engine, spec = llm.engine, llm.engine.spec
    model = engine.model
    calls, spent = [0], [0.0]
    forward_mtp, propose = model.forward_mtp, spec.propose

    def counted(*a, **kw):
        calls[0] += 1
        return forward_mtp(*a, **kw)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        propose(*a, **kw)
        spent[0] += time.perf_counter() - t0

    model.forward_mtp, spec.propose = counted, timed
    try:
        prompts = repetitive_prompts(777, batch, vocab)
        _timed(llm, prompts, 1)
        rounds, ahead, fallbacks = (
            spec.stats.num_drafts,
            engine.overlap.ahead,
            engine.overlap.fallbacks,
        )
        calls[0], spent[0] = 0, 0.0
        total, _ = _timed(llm, prompts, tokens + 1)
    finally:
        del model.forward_mtp, spec.propose  # the instance attributes: back to the methods
    return dict(
        run_ms=round(1e3 * total, 2), mtp_forwards=calls[0], propose_ms=round(1e3 * spent[0], 2),
        rounds=spec.stats.num_drafts - rounds, ahead=engine.overlap.ahead - ahead,
        sync_fallbacks=engine.overlap.fallbacks - fallbacks,
    )  # fmt: skip


def _mtp_shape(
    rows: list, shape: str, config: dict, weights, deadline: float, control: bool = False
) -> None:
    """Plain against `--speculative mtp` (k = 3, throttle on) over the same random weights (the
    MTP layer's drafts are never accepted): both engines built, their runs alternated
    `MTP_ROUNDS` times per batch (a small model's tok/s swings between minutes of one call by
    more than the difference measured), medians and their ratio, the MTP run's breakdown, and
    whether greedy output is equal. `control`: a second plain engine in the alternation, its
    ratio to the first the spread two identical engines show."""
    import speed

    from deepserve.engine.config import SpeculativeConfig

    vocab = config["vocab_size"]
    label = dict(shape=shape, dtype="bfloat16", batch_invariant=False)
    kinds = {"plain": {}, "mtp": dict(speculative=SpeculativeConfig("mtp", K))}
    if control:
        kinds["control"] = {}
    llms = {
        run: speed.build_llm_over(
            config,
            weights,
            False,
            max_num_seqs=8,
            max_model_len=1024,
            kv_cache_bytes=2**30,
            enable_prefix_caching=False,
            **kw,
        )  # fmt: skip
        for run, kw in kinds.items()
    }
    outputs: dict[str, dict] = {run: {} for run in kinds}

    def spans(seed: int, batch: int) -> list[list[int]]:
        return repetitive_prompts(seed, batch, vocab)

    for batch in BATCHES:
        runs: dict[str, list[float]] = {run: [] for run in kinds}
        for r in range(MTP_ROUNDS):
            if time.time() > deadline:
                break
            order = list(llms.items())  # which engine goes first rotates too
            for run, llm in order[r % len(order) :] + order[: r % len(order)]:
                tok_s, outputs[run][batch] = decode_run(
                    llm, spans, batch, 10 * batch, tokens=MTP_TOKENS
                )
                runs[run].append(round(tok_s, 1))
        if not runs["mtp"]:
            break
        plain, mtp = statistics.median(runs["plain"]), statistics.median(runs["mtp"])
        row = dict(label, batch=batch, plain_tok_s=plain, mtp_tok_s=mtp,
                   ratio_to_plain=round(mtp / plain, 3),
                   ratio_median_of_rounds=round(statistics.median(
                       m / p for m, p in zip(runs["mtp"], runs["plain"], strict=False)), 3),
                   **({"control_ratio_median_of_rounds": round(statistics.median(
                       c / p for c, p in zip(runs["control"], runs["plain"], strict=False)), 3)}
                      if control else {}),
                   **{f"{run}_runs": " / ".join(map(str, v)) for run, v in runs.items()})  # fmt: skip
        row |= mtp_breakdown(llms["mtp"], vocab, batch, MTP_TOKENS)
        rows.append(row)
        print(row, flush=True)
    for llm in llms.values():
        _release(llm)
    equal_rows(rows, dict(label, run="mtp vs plain"), outputs["plain"], outputs["mtp"])


def section_spec_mtp(out: dict, deadline: float) -> None:
    """Issue 34's random-MTP row alone (~3 minutes): tiny-deepseek (vocabulary 129,280: a graph
    step is ~0.2 ms, so host work shows) and the V2-Lite geometry (27 layers, DeepseekV3
    architecture) with one random MTP layer, plain against MTP at batch 1 and 8."""
    from deepserve.engine.testmodels.model_shapes import DEEPSEEK_V2_LITE_AS_V3, random_weights
    from deepserve.engine.testmodels.tiny_deepseek import TINY_CONFIG, _tensors

    rows = out.setdefault("spec_mtp", [])
    config = dict(TINY_CONFIG, vocab_size=129280)
    weights = _tensors(config, torch.Generator().manual_seed(0))
    _mtp_shape(rows, "tiny-deepseek", config, weights, deadline, control=True)
    if time.time() > deadline:
        return
    config = dict(DEEPSEEK_V2_LITE_AS_V3, num_nextn_predict_layers=1)
    weights = random_weights(config, "cuda", 0, fused_experts=True)
    _mtp_shape(rows, "v2-lite + random MTP layer", config, weights, deadline)
    weights.clear()
    torch.cuda.empty_cache()


PARTS = ("smollm2", "mtp", "v2-lite")


def section_spec_speed(out: dict, deadline: float, parts: tuple[str, ...] = PARTS) -> None:
    """`parts`: the SmolLM2 and V2-Lite shapes' n-gram runs and tiny-deepseek's MTP run."""
    rows = out.setdefault("spec_speed", [])
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)
    for part in parts:
        if time.time() > deadline:
            break
        if part == "mtp":
            _mtp(rows, deadline)
        else:
            _shape(rows, part, deadline)
