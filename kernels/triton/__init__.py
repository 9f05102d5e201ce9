"""Triton kernels for CUDA: the default KernelSet's and `--batch-invariant`'s (one fixed tile
configuration per op, so a row's result never depends on how many rows share the launch).

- `lang.py`: the import shim (these modules import without Triton; kernels are only launched with it)
- `matmul.py`: invariant matmul for `linear` and `bmm` (tiles and K chunks fixed by the weight)
- `fp8_matmul.py`: block-scaled FP8 GEMM for `Fp8Weight`s, activations quantized per 1 x 128
- `fp8_gemv.py`: the default set's few-row path for FP8 weights (x unquantized) and one row of
  the largest bf16 / float32 ones: the weight streamed once, fixed split-K summed in order in the
  same launch
- `rows.py`: row-per-program RMSNorm, softmax and log_softmax
- `attention.py`: fixed-split paged attention over the block-table KV cache (prefill and decode alike)
- `flash_prefill.py`: causal varlen flash attention over gathered per-head keys (MLA's prefill
  chunks in the decompressed form)
- `decode_attention.py`: graph-safe paged attention for pure decode steps (MLA and GQA), and the
  invariant set's head-grouped decode path
- `sparse_attention.py`: DeepSeek-V4's batched sink attention over slot lists, lightning-indexer
  scores and compressor pooling; `topk.py`: the indexer's top-k as ascending index lists (a
  one-launch radix select)
- `hyper_connections.py`: DeepSeek-V4's hyper-connections (collapse with the Sinkhorn mix,
  expand, hyper head), one launch each
- `fused_moe.py`: every routed expert in two grouped GEMMs, pairs sorted by expert on the device
- `kernelset.py`: `fast_kernels(base)` (the CUDA default) and `triton_kernels(base)`
  (`--batch-invariant`), over the base set kernels/registry.py passes in
- `routing.py`: MoE routing in one launch; `rope.py`, `mla.py`: fused rope + KV-cache writes
"""
