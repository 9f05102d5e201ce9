"""Writers of test models: checkpoints with seeded random weights in real architectures, written as
ordinary HF folders so they load through engine/loading/ exactly as real checkpoints do.

`tiny_deepseek.py`: the tiny DeepSeek-V3 checkpoint the tests and demos check against transformers.
`tiny_deepseek_v4.py`: the same for the DeepSeek-V4 architecture, in the layout of
`deepseek_v4_layout.py` (the published V4 tensor names and shapes, shared with model_shapes.py).
`model_shapes.py`: real models' shapes (DeepSeek-V2-Lite, the DeepSeek-V3 slice, DeepSeek-V4-Flash,
SmolLM2-135M) for the GPU benchmarks.
`quantize.py`: the DeepSeek-V3 and V4 ones in the FP8 / MXFP4 layouts DeepSeek publishes them in.
`deepserve make-test-model` (server/cli.py) writes either. Not for text: the weights are random.
"""
