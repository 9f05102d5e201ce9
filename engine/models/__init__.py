"""Model families the engine runs: `llama` (SmolLM2) and `deepseek_v3` (MLA + MoE + MTP)."""
