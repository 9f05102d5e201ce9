"""Tokenizers for the engine, always a `tokenizers.Tokenizer`: from a tokenizer.json, or rebuilt
from the vocabulary a GGUF file embeds (gpt2-style byte-level BPE). Chat templates and stop tokens
are carried in `ModelInfo`, not here."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from deepserve.engine.errors import ModelNotFoundError, UnsupportedModelError

# GGUF token types (llama.cpp's llama_token_type): control tokens become special added tokens.
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


def load_tokenizer_json(path: Path) -> Tokenizer:
    if not path.exists():
        raise ModelNotFoundError(f"tokenizer file {path} does not exist")
    return Tokenizer.from_file(str(path))


def tokenizer_from_gguf(
    model: str,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    bos_token_id: int | None,
    add_bos: bool,
) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` fields."""
    if model != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {model!r} is not supported (only gpt2-style byte-level BPE)"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    if add_bos and bos_token_id is not None:
        bos = tokens[bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
        )
    return tok
