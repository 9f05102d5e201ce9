"""The registry of architectures: a checkpoint's architecture name (config.json `architectures[0]`)
-> its model class under engine/models/. A new model family is added to `ARCHITECTURES` here."""

from __future__ import annotations

import importlib

from deepserve.engine.errors import UnsupportedModelError

# architecture -> (module under deepserve.engine.models, class); imported only when asked for
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v3", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV4ForCausalLM": ("deepseek_v4", "DeepseekV4ForCausalLM"),
}


def architecture_of(config: dict) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedModelError("model config names no architecture ('architectures' is empty)")
    return archs[0]


def model_class(architecture: str) -> type:
    if architecture not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported ({known})")
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"deepserve.engine.models.{module}"), name)
