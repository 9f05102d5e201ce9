"""xgrammar, importable where HuggingFace transformers is not installed (the Docker image).

xgrammar 0.2.x imports transformers when it is imported, though only its transformers helpers
use it (`TokenizerInfo.from_huggingface`, `contrib.hf.LogitsProcessor`); deepserve builds its
`TokenizerInfo` from the vocabulary (engine/structured.py) and calls neither. transformers and
its dependency tree would be about a tenth of the CPU image, so the image leaves them out. There,
during xgrammar's import only, the names it takes from transformers are bound to empty classes;
afterwards `transformers` is absent again for every other importer. Where transformers is
installed, this is a plain import.
"""

from __future__ import annotations

import importlib.util
import sys
import types

# What xgrammar's modules take from transformers at import time.
_NAMES = ("PreTrainedTokenizerBase", "PreTrainedTokenizerFast", "LogitsProcessor")


def _absent_transformers() -> types.ModuleType:
    module = types.ModuleType("transformers", "not installed; names for xgrammar's import only")
    for name in _NAMES:
        setattr(module, name, type(name, (), {}))
    return module


def _import_xgrammar() -> types.ModuleType:
    if importlib.util.find_spec("transformers") is not None:
        import xgrammar

        return xgrammar
    previous = sys.modules.get("transformers", ...)
    sys.modules["transformers"] = _absent_transformers()
    try:
        import xgrammar
    finally:
        if previous is ...:
            del sys.modules["transformers"]
        else:
            sys.modules["transformers"] = previous
    return xgrammar


xgrammar = _import_xgrammar()
