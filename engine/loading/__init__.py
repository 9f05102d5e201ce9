"""From a model name to a model ready to run: every checkpoint reader and the model registries.

`loader.py` `load_model(config) -> LoadedModel` is the entry point. `builtin_models.py` maps the
built-in names to their files (and fetches them); `hf_loader.py` reads an HF folder (its FP8 /
MXFP4 weights through `quantized.py`), `gguf_loader.py` a GGUF file (its byte format in
`gguf_format.py`), both into a `checkpoint.py` `Checkpoint`; `tokenizer.py` builds the
`tokenizers.Tokenizer`; `architectures.py` maps a checkpoint's architecture to its model class
under engine/models/.

What does not live here: the networks (engine/models/), a rank's share of the weights
(engine/parallel/), checkpoints we write ourselves for tests and benchmarks (engine/testmodels/).
"""
