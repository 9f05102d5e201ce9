"""R1-style reasoning for chat-template families: where parsing of a model's output starts.

DeepSeek-R1 and its Distill models render the assistant turn as `<｜Assistant｜><think>\\n`: the
output starts inside the think block, and the text up to `</think>` is reasoning, the rest the
answer (vLLM's deepseek_r1 reasoning parser; output that never closes the block is all reasoning).
Whether a prompt opens the block is read off the rendered prompt, so a template that opens it only
on some requests is followed request by request. The parsing itself is deepseek-recipe's
StreamProcessor (server/stream.py), which DeepSeek-V4's output goes through too: it puts the
reasoning in `reasoning_content` (Chat Completions) and reasoning items (Responses), streamed and
not. Not here: DeepSeek-V4's own thinking modes (server/family.py DeepSeekFamily).
"""

from __future__ import annotations

import deepseek_recipe as dr

THINK_START, THINK_END = "<think>", "</think>"  # one token each in the R1 and V4 tokenizers


def opens_think_block(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open think block (`<think>`, then whitespace)."""
    return prompt.rstrip().endswith(THINK_START)


def template_parsing(options: dr.ParsingOptions, prompt: str) -> dr.ParsingOptions:
    """The parsing of a chat-template model's output: plain text (DeepSeek's tool-call markup is
    not parsed), starting in reasoning when `prompt` opens a think block."""
    stage = dr.ThinkingInitialStage.ReasoningStart if opens_think_block(prompt) else None
    return dr.ParsingOptions(
        parse_tool_calls=False,
        starts_in_tool_calls=False,
        parse_json_output=options.parse_json_output,
        thinking_initial_stage=stage,
        stop_sequences=options.stop_sequences,
    )
