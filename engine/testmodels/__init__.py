"""Writers of test models: checkpoints with seeded random weights in real architectures, written as
ordinary HF folders so they load through engine/loading/ exactly as real checkpoints do.

`tiny_deepseek.py`: the tiny DeepSeek-V3 checkpoint the tests and demos check against transformers.
`model_shapes.py`: real models' shapes (DeepSeek-V2-Lite, SmolLM2-135M) for the GPU benchmarks.
`deepserve make-test-model` (server/cli.py) writes either. Not for text: the weights are random.
"""
