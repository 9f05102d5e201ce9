"""Real-shape speed on the GPU (issue 15): decode and prefill tokens/s of deepserve (default and
`--batch-invariant`) beside transformers `generate` on the same random bf16 weights in one
process, a profile of one decode step (kernels, device-to-host copies, GPU busy fraction) and
one of a 2,000-token prefill.

Shapes: DeepSeek-V2-Lite (15.7B: MLA, 64 routed experts top-6 + 2 shared, 27 layers, in the
DeepseekV3 architecture with a 4K context: model_shapes' `deepseek-v2-lite-v3arch`) and
SmolLM2-135M. transformers builds the model with its own random init; deepserve's model is built
over the very same tensors (no copy of the experts). `quantization` "fp8": deepserve's projections
and experts quantized on the device to DeepSeek-V3's published FP8 blocks (e4m3, 128 x 128
float32 scales; what the V3 checkpoints keep in bf16 stays so) and run by the FP8 kernels, beside
the bf16 rows of the same call. Imported by run_all.py.
"""

from __future__ import annotations

import random
import re
import statistics
import time

import torch

from deepserve.engine.testmodels.model_shapes import DEEPSEEK_V2_LITE_AS_V3, SMOLLM2_135M

SHAPES = {"v2-lite": DEEPSEEK_V2_LITE_AS_V3, "smollm2": SMOLLM2_135M}
# what DeepSeek-V3's FP8 checkpoints keep in bf16 (and norms, biases: not matrices)
_FP8_KEEP = re.compile(r"(embed_tokens|lm_head|shared_head\.head|mlp\.gate)\.weight$")


def _sync() -> None:
    torch.cuda.synchronize()


def build_hf(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    skip = ("architectures", "model_type", "torch_dtype")
    rest = {k: v for k, v in config.items() if k not in skip}
    cfg = AutoConfig.for_model(config["model_type"], **rest)
    cfg.architectures = config["architectures"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return hf.eval()


def fp8_weights(weights: dict[str, torch.Tensor]) -> dict:
    """The matrices (fused experts too) as block-scaled FP8, made on the device one at a time."""
    from deepserve.kernels.block_quant import quantize_fp8

    def quantized(name: str, t: torch.Tensor) -> bool:
        matrix = name.endswith((".weight", "_proj")) and t.dim() >= 2
        return matrix and not _FP8_KEEP.search(name)

    return {n: quantize_fp8(t) if quantized(n, t) else t for n, t in weights.items()}


def build_llm(config: dict, hf, batch_invariant: bool, quantization: str = "bf16", **kw):
    """deepserve's engine over transformers' tensors (same weights, one copy of the experts;
    `quantization` "fp8": an FP8 copy of the matrices instead)."""
    weights = dict(hf.state_dict())
    if quantization == "fp8":
        weights = fp8_weights(weights)
    return build_llm_over(config, weights, batch_invariant, quantization=quantization, **kw)


def build_llm_over(
    config: dict,
    weights,
    batch_invariant: bool,
    dtype: str = "bfloat16",
    quantization: str = "bf16",
    kv_cache_dtype: str = "auto",
    **kw,
):
    """deepserve's engine over `weights` (HF-named tensors, or a mapping that makes each one on
    request, so a checkpoint larger than half the card is never held twice), with a
    `kv_cache_dtype` KV cache ("auto" or "fp8")."""
    from deepserve.engine.config import EngineConfig
    from deepserve.engine.contract import ModelInfo
    from deepserve.engine.llm import LLM
    from deepserve.engine.loading.architectures import model_class
    from deepserve.engine.loading.loader import LoadedModel
    from deepserve.engine.models.common import WeightStore
    from deepserve.kernels.kv_quant import KV_CACHE_DTYPES
    from deepserve.kernels.registry import get_kernels

    store = WeightStore(weights, torch.device("cuda"), getattr(torch, dtype))
    arch = config["architectures"][0]
    kernels = get_kernels("cuda", batch_invariant)
    model = model_class(arch)(
        config, store, kernels, f"bench-{arch}-{batch_invariant}-{quantization}-{kv_cache_dtype}",
        kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype],
    )  # fmt: skip
    info = ModelInfo(
        arch, model.family, arch, "", config["vocab_size"], config["max_position_embeddings"],
        [config["eos_token_id"]], None, None, model.fingerprint, 0,
    )  # fmt: skip
    kw.setdefault("kv_cache_bytes", 8 * 2**30)
    engine_config = EngineConfig(
        model=arch, device="cuda", dtype=dtype, batch_invariant=batch_invariant,
        kv_cache_dtype=kv_cache_dtype, **kw,
    )  # fmt: skip
    return LLM(engine_config, LoadedModel(model, None, info))


def greedy(max_tokens: int):
    from deepserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def engine_decode_tok_s(llm, batch: int, vocab: int, rng: random.Random, tokens: int) -> float:
    """Tokens/s of `batch` 128-token prompts x `tokens` outputs, the prefill timed apart and
    taken out: decode steps only."""
    llm.generate(prompts(rng, batch, 128, vocab), greedy(8))  # warm-up: captures this bucket
    ps = prompts(rng, batch, 128, vocab)
    _sync()
    t0 = time.perf_counter()
    llm.generate(ps, greedy(1))
    _sync()
    t_prefill = time.perf_counter() - t0
    ps = prompts(rng, batch, 128, vocab)
    _sync()
    t0 = time.perf_counter()
    llm.generate(ps, greedy(tokens + 1))
    _sync()
    return batch * tokens / (time.perf_counter() - t0 - t_prefill)


def decode_steps_tok_s(llm, prompts_: list[list[int]], tokens: int) -> float:
    """Tokens/s of the decode steps alone: the steps after every prompt has its first token,
    timed on the engine's own step loop (long prompts: a prefill timed apart varies by more
    than a short decode lasts)."""
    engine = llm.engine
    for i, ids in enumerate(prompts_):
        engine.add_admitted(f"decode-{i}-{id(prompts_)}", engine.admit(ids, greedy(tokens + 1)))
    started: set[str] = set()
    while len(started) < len(prompts_):
        started.update(out.request_id for out in engine.step())
    _sync()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    _sync()
    return len(prompts_) * tokens / (time.perf_counter() - t0)


def hf_decode_tok_s(hf, batch: int, vocab: int, rng: random.Random, tokens: int) -> float:
    def run(n: int) -> float:
        ids = torch.tensor(prompts(rng, batch, 128, vocab), device="cuda")
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, **kw)
        _sync()
        return time.perf_counter() - t0

    run(4)
    return batch * tokens / (run(tokens + 1) - run(1))


def engine_prefill_tok_s(llm, vocab: int, rng: random.Random, length: int) -> float:
    times = []
    for _ in range(4):  # fresh prompts: a repeat would be served from the prefix cache
        p = prompts(rng, 1, length, vocab)
        _sync()
        t0 = time.perf_counter()
        llm.generate(p, greedy(1))
        _sync()
        times.append(time.perf_counter() - t0)
    return length / statistics.median(times[1:])


def hf_prefill_tok_s(hf, vocab: int, rng: random.Random, length: int) -> float:
    times = []
    for _ in range(4):
        ids = torch.tensor(prompts(rng, 1, length, vocab), device="cuda")
        _sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf(ids, logits_to_keep=1)
        _sync()
        times.append(time.perf_counter() - t0)
    return length / statistics.median(times[1:])


def profile_decode_step(llm, batch: int, vocab: int, rng: random.Random) -> dict:
    """One decode step of `batch` running sequences under torch.profiler: kernels launched
    (inside graphs too), device-to-host copies, synchronizing calls, and the GPU busy fraction
    (kernel time over the step's wall time)."""
    engine = llm.engine
    for i, p in enumerate(prompts(rng, batch, 128, vocab)):
        engine.add_request(f"prof-{batch}-{i}", p, greedy(64))
    chunk = engine.config.max_num_batched_tokens
    for _ in range(-(-batch * 128 // chunk) + 2):  # the prefill chunks, then two decode steps
        engine.step()
    return dict(batch=batch, **profile_next_step(engine))


def profile_next_step(engine) -> dict:
    """The engine's next step under torch.profiler (`_summary`), then its requests run out."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.step()
        _sync()
        wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return _summary(prof, wall)


def profile_prefill(llm, vocab: int, rng: random.Random, length: int) -> dict:
    """One `length`-token prompt's prefill (its one step, or its chunks) under torch.profiler:
    the same summary as a decode step's, plus the host ops that took the most CPU time (eager
    prefill launches every kernel from Python)."""
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompts(rng, 1, length, vocab), greedy(1))  # warm: this length's kernels built
    p = prompts(rng, 1, length, vocab)
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(p, greedy(1))
        _sync()
        wall = time.perf_counter() - t0
    ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
    host = [(a.key[:50], a.count, round(a.self_cpu_time_total)) for a in ops]
    return dict(tokens=length, **_summary(prof, wall, top=20), host_top_us=host)


def _summary(prof, wall: float, top: int = 12) -> dict:
    """Kernels launched (inside graphs too), device-to-host copies, synchronizing calls, kernel
    time, the GPU busy fraction (kernel time over wall) and the costliest kernels."""
    kernels = d2h = syncs = 0
    busy_us = 0.0
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if "Memcpy DtoH" in name or "Memcpy D2H" in name:
                d2h += 1
            elif "Memcpy" not in name and "Memset" not in name:
                kernels += 1
                busy_us += e.device_time
                entry = by_name.setdefault(name[:70], [0, 0.0])
                entry[0] += 1
                entry[1] += e.device_time
        elif "Synchronize" in name:
            syncs += 1
    return dict(
        wall_ms=wall * 1e3, kernels=kernels, d2h_copies=d2h, sync_calls=syncs,
        kernel_ms=busy_us / 1e3, gpu_busy=busy_us / 1e6 / wall,
        top=[(n, c, round(us)) for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
    )  # fmt: skip


def _out_of_time(out: dict, deadline: float, what: str) -> bool:
    """Past the section's deadline: say what is skipped in the results' errors (run 8-4 lost its
    deepserve figures to a deadline without a word)."""
    if time.time() <= deadline:
        return False
    out["errors"].append(f"{what}: skipped, out of time")
    return True


def section_speed(
    out: dict,
    shapes: list[str],
    batches: dict,
    tokens: int,
    deadline: float,
    quantizations: tuple[str, ...] = ("bf16",),
):
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN plans per length skew transformers
    for name in shapes:
        config = SHAPES[name]
        t0 = time.time()
        hf = build_hf(config)
        out.setdefault("build_s", {})[name] = round(time.time() - t0, 1)
        for quant in quantizations:
            for flag in (False, True):
                if _out_of_time(out, deadline, f"speed: deepserve {name} {quant}, flag {flag}"):
                    break
                _deepserve_rows(out, name, hf, flag, quant, batches[name], tokens, deadline)
                torch.cuda.empty_cache()
        _transformers_rows(out, name, hf, batches[name], tokens, deadline)
        del hf
        torch.cuda.empty_cache()


def _deepserve_rows(
    out: dict, name: str, hf, flag: bool, quant: str, batches: list, tokens: int, deadline: float
) -> None:
    config, rows, profiles = (
        SHAPES[name],
        out.setdefault("speed", []),
        out.setdefault("profile", []),
    )
    vocab = config["vocab_size"]
    rng = random.Random(3)
    llm = build_llm(config, hf, flag, quant, max_model_len=4096)
    row = dict(shape=name, system="deepserve", quantization=quant, batch_invariant=flag)
    for b in batches:
        if _out_of_time(out, deadline, f"speed: deepserve {name} {quant} batch {b}, flag {flag}"):
            break
        tok_s = engine_decode_tok_s(llm, b, vocab, rng, tokens)
        rows.append(dict(row, batch=b, decode_tok_s=tok_s))
        print(rows[-1], flush=True)
    rows.append(dict(row, prefill_2000_tok_s=engine_prefill_tok_s(llm, vocab, rng, 2000)))
    print(rows[-1], flush=True)
    if not flag or name == "v2-lite":
        prof = profile_prefill(llm, vocab, rng, 2000)
        prof = dict(shape=name, quantization=quant, batch_invariant=flag, **prof)
        out.setdefault("prefill_profile", []).append(prof)
        print(out["prefill_profile"][-1], flush=True)
    if name == "v2-lite" or not flag:
        for b in batches[:: max(1, len(batches) - 1)]:
            prof = profile_decode_step(llm, b, vocab, rng)
            profiles.append(dict(shape=name, quantization=quant, batch_invariant=flag, **prof))
            print(profiles[-1], flush=True)
    llm.engine.runner.close()


def _transformers_rows(
    out: dict, name: str, hf, batches: list, tokens: int, deadline: float
) -> None:
    rows, vocab = out.setdefault("speed", []), SHAPES[name]["vocab_size"]
    rng = random.Random(3)
    for b in batches:
        if _out_of_time(out, deadline, f"speed: transformers {name} batch {b}"):
            break
        rows.append(dict(shape=name, system="transformers", batch=b,
                         decode_tok_s=hf_decode_tok_s(hf, b, vocab, rng, tokens)))  # fmt: skip
        print(rows[-1], flush=True)
    rows.append(dict(shape=name, system="transformers",
                     prefill_2000_tok_s=hf_prefill_tok_s(hf, vocab, rng, 2000)))  # fmt: skip
    print(rows[-1], flush=True)
