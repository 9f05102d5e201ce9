"""DeepSeek-V4 on the H200 (issue 28): the V4-Flash geometry beside transformers in one call.

`section_v4_parity`: a 3-layer full-width slice (sliding, CSA, HCA; hash-MoE first; 32 routed
experts instead of 256, so two float32 copies fit the card) written as a published-layout
checkpoint; transformers' `DeepseekV4ForCausalLM` loads it. float32 last-position logits at 1,
17, 300 and 2,000 tokens, and bf16 32-token greedy agreement, deepserve against transformers.

`section_v4_speed`: the 6-layer V4-Flash slice (2 sliding, then CSA / HCA alternating, hash-MoE in
the first 3, 256 experts: 40.6 B parameters, 81 GB in bf16). transformers first (its random init,
its own `generate`), freed, then deepserve over tensors made one at a time on the device (the
slice is never held twice): decode tokens/s at batch 1 / 32 / 64 after 128-token prompts,
2,000- and 8,192-token prefill, a profile of one decode step at batch 1 and 64, and one fresh
32,768- and 131,072-token prompt each (TTFT, then batch-1 decode over that context), with the KV
bytes a token costs beside a V3-architecture MLA layer's. With `quantizations` holding
"fp8-mxfp4" (run_all.py `--v4-quantization`), the deepserve rows run again on the slice in V4's
published format, made on the device tensor by tensor: FP8 dense projections (e4m3, UE8M0 scales
per 128 x 128) and MXFP4 routed experts, as the loader keeps them for the CUDA sets. Imported by
run_all.py (sections `v4_parity`, `v4`).
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path

import long_prompts
import speed
import torch

from deepserve.engine.testmodels.deepseek_v4_layout import tensor_specs
from deepserve.engine.testmodels.model_shapes import (
    DEEPSEEK_V4_FLASH,
    v4_layer_schedule,
    v4_tensor,
    write_shaped_model,
)

SLICE_LAYERS = 6
CONTEXT = 163_840  # the engine's max_model_len for the slice: a 131,072-token prompt and its decode
LONG_LENGTHS = (32_768, 131_072)
V3_MLA_ROW_BYTES = (512 + 64) * 2  # a V3 MLA layer's KV row in bf16: the 512-dim latent + rope key


def slice_config(layers: int = SLICE_LAYERS, **overrides) -> dict:
    return dict(DEEPSEEK_V4_FLASH, **v4_layer_schedule(layers), **overrides)


QUANTIZATIONS = ("bf16", "fp8-mxfp4")


class LazyV4Weights(Mapping):
    """The V4 layout's tensors, each made on the device when the loader asks for it and not kept:
    the model stacks a layer's experts from them and the per-expert tensors are freed. With
    `quantization` "fp8-mxfp4", each matrix the published checkpoint quantizes comes as the
    loader keeps it (`Fp8Weight` with UE8M0 scales as float32, `Mxfp4Weight` experts)."""

    def __init__(self, config: dict, seed: int = 0, quantization: str = "bf16") -> None:
        self.config = config
        self.specs = tensor_specs(config)
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.quantization = quantization

    def __getitem__(self, name: str):
        t = v4_tensor(self.config, self.specs[name], "cuda", self.gen)
        if self.quantization == "bf16":
            return t
        return _published(name, t)

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def _published(name: str, t: torch.Tensor):
    """`t` as V4's published checkpoint stores it, in the form the loader keeps it on a set
    that runs FP8 / MXFP4 (engine/loading/quantized.py)."""
    from deepserve.engine.loading.quantized import scale_to_float
    from deepserve.engine.testmodels.quantize import published_format, quantize_fp8, quantize_mxfp4
    from deepserve.kernels.block_quant import Fp8Weight, Mxfp4Weight

    fmt = published_format(name, t, v4=True, method="mxfp4")
    if fmt == "mxfp4":
        values, scale = quantize_mxfp4(t)
        return Mxfp4Weight(values.view(torch.uint8), scale)
    if fmt == "fp8":
        values, scale = quantize_fp8(t, ue8m0=True)
        return Fp8Weight(values, scale_to_float(scale))
    return t


def _record(out: dict, key: str, row: dict) -> None:
    out.setdefault(key, []).append(row)
    print(row, flush=True)


# ---- parity ---------------------------------------------------------------------------------


def section_v4_parity(out: dict, work: Path) -> None:
    from run_all import engine_logits  # the job's own "logits of one cold prompt" helper
    from transformers import AutoModelForCausalLM

    from deepserve.engine.config import EngineConfig
    from deepserve.engine.llm import LLM

    overrides = dict(v4_layer_schedule(3), n_routed_experts=32)
    folder = write_shaped_model("deepseek-v4-flash", work / "v4-parity", "cuda", 0, overrides)
    rng = random.Random(11)
    prompts = {n: [rng.randrange(3, 129_000) for _ in range(n)] for n in (1, 17, 300, 2000)}
    greedy_prompts = [[rng.randrange(3, 129_000) for _ in range(n)] for n in (20, 150)]
    for dtype in ("float32", "bfloat16"):
        # every parameter in `dtype`: transformers 5.17 keeps V4's mixing weights in float32
        # under dtype=bfloat16 and then feeds their float32 output to a bf16 projection
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        hf = hf.to(device="cuda", dtype=getattr(torch, dtype)).eval()
        with torch.inference_mode():
            want = {
                n: hf(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu()
                for n, p in prompts.items()
            }
            hf_tokens = [
                hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                            do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in greedy_prompts
            ]  # fmt: skip
        del hf
        torch.cuda.empty_cache()
        for flag in (False, True):
            cfg = EngineConfig(model=str(folder), device="cuda", dtype=dtype, batch_invariant=flag,
                               kv_cache_bytes=4 * 2**30)  # fmt: skip
            llm = LLM(cfg)
            diffs = {}
            for n, p in prompts.items():
                got = engine_logits(llm, p, "cuda").cpu()
                ref = want[n]
                diffs[n] = dict(max_abs=float((got - ref).abs().max()),
                                rel=float((got - ref).norm() / ref.norm()))  # fmt: skip
            ours = [r.token_ids for r in llm.generate(greedy_prompts, speed.greedy(32))]
            agree = [
                next((i for i, (a, b) in enumerate(zip(h, o, strict=False)) if a != b), 32)
                for h, o in zip(hf_tokens, ours, strict=True)
            ]
            _record(out, "v4_parity", dict(dtype=dtype, batch_invariant=flag, logits=diffs,
                                           greedy_tokens_agreeing=agree))  # fmt: skip
            llm.engine.runner.close()
            del llm
            torch.cuda.empty_cache()


# ---- speed ----------------------------------------------------------------------------------


def _hf_rows(out: dict, config: dict, batches: list[int], tokens: int, deadline: float) -> None:
    t0 = time.time()
    hf = speed.build_hf(config)
    out.setdefault("v4_build_s", {})["transformers"] = round(time.time() - t0, 1)
    rng, vocab = random.Random(3), config["vocab_size"]
    try:
        for b in batches:
            if time.time() > deadline:
                out["errors"].append(f"v4: transformers batch {b}: out of time")
                break
            tok_s = speed.hf_decode_tok_s(hf, b, vocab, rng, tokens)
            _record(out, "v4_speed", dict(system="transformers", batch=b, decode_tok_s=tok_s))
        for n in (2000, 8192):
            tok_s = speed.hf_prefill_tok_s(hf, vocab, rng, n)
            _record(out, "v4_speed", dict(system="transformers", prefill_tokens=n, tok_s=tok_s))
    except torch.OutOfMemoryError as e:
        out["errors"].append(f"v4: transformers: {str(e)[:200]}")
    del hf
    torch.cuda.empty_cache()


def _kv_bytes(model) -> dict:
    spec = model.kv_cache_spec
    itemsize = torch.empty(0, dtype=spec.dtype).element_size()
    per_token = spec.num_layers * spec.width * itemsize
    v3 = (model.args.num_layers + model.num_mtp_layers) * V3_MLA_ROW_BYTES  # one row a layer
    return dict(kv_bytes_per_token=per_token, v3_mla_bytes_per_token=v3, ratio=per_token / v3)


def _ours_rows(
    out: dict, config: dict, batches: list[int], tokens: int, deadline: float, quant: str
) -> None:
    t0 = time.time()
    weights = LazyV4Weights(config, quantization=quant)
    llm = speed.build_llm_over(config, weights, False, quantization=quant, max_model_len=CONTEXT,
                               kv_cache_bytes=24 * 2**30, max_num_batched_tokens=8192)  # fmt: skip
    out.setdefault("v4_build_s", {})[f"deepserve {quant}"] = round(time.time() - t0, 1)
    out["v4_kv"] = _kv_bytes(llm.engine.model)
    out["v4_graphs"] = getattr(llm.engine.runner, "graphs", None) is not None
    out.setdefault("v4_allocated_bytes", {})[quant] = torch.cuda.memory_allocated()  # + KV pool
    rng, vocab, key = random.Random(3), config["vocab_size"], dict(quantization=quant)
    for b in batches:
        if time.time() > deadline:
            out["errors"].append(f"v4: deepserve {quant} batch {b}: out of time")
            break
        # the decode steps on the engine's loop: a prefill timed apart and subtracted varied by
        # more than 15% of the decode's time (one batch-64 row read 6,955 tok/s over 10.9 ms of
        # kernels a step, run-gpu23-1)
        llm.generate(speed.prompts(rng, b, 128, vocab), speed.greedy(8))  # captures this bucket
        tok_s = speed.decode_steps_tok_s(llm, speed.prompts(rng, b, 128, vocab), tokens)
        _record(out, "v4_speed", dict(system="deepserve", **key, batch=b, decode_tok_s=tok_s))
    for n in (2000, 8192):
        tok_s = speed.engine_prefill_tok_s(llm, vocab, rng, n)
        _record(out, "v4_speed", dict(system="deepserve", **key, prefill_tokens=n, tok_s=tok_s))
    for b in (batches[0], batches[-1]):
        _record(out, "v4_profile", dict(**key, **speed.profile_decode_step(llm, b, vocab, rng)))
    _record(out, "v4_profile", dict(**key, **speed.profile_prefill(llm, vocab, rng, 2000)))
    for n in LONG_LENGTHS:
        if time.time() > deadline:
            out["errors"].append(f"v4: long prompt {n}: out of time")
            break
        try:
            row = long_prompts.prompt_row(llm, n, vocab, rng)
        except Exception:
            row = dict(prompt_tokens=n, error=traceback.format_exc()[-1200:])
        _record(out, "v4_long", dict(**key, **row))
    llm.engine.runner.close()
    del llm
    torch.cuda.empty_cache()


def section_v4_speed(
    out: dict,
    deadline: float,
    batches=(1, 32, 64),
    tokens: int = 64,
    with_hf: bool = True,
    quantizations: tuple[str, ...] = ("bf16",),
) -> None:
    """transformers' rows (bf16), then deepserve's for each of `quantizations` in turn (the
    slice built, measured and freed before the next)."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    config = slice_config()
    if with_hf:
        _hf_rows(out, config, list(batches), min(tokens, 32), deadline - 240)
    for quant in quantizations:
        if time.time() > deadline:
            out["errors"].append(f"v4: deepserve {quant}: out of time")
            continue
        _ours_rows(out, config, list(batches), tokens, deadline, quant)
