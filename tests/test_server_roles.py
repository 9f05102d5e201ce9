"""Message roles as OpenAI clients send them: `developer` is served as `system` on Chat Completions
and Responses, for both model families (SmolLM2's chat template, tiny-deepseek's DeepSeek
encoding), and a role error names only the roles a client may send. Checked with the openai SDK."""

from __future__ import annotations

import openai
import pytest
from server_harness import engine_for, running_server, sdk_client, smollm_engine

__all__ = ["smollm_engine"]  # shared fixture (server_harness)

INSTRUCTION = "Answer in French."
QUESTION = {"role": "user", "content": "Say hello."}


@pytest.fixture(scope="module", params=["smollm2-135m", "tiny-deepseek"])
def served(request, smollm_engine):
    """(openai client, served model name) for each model family."""
    name = request.param
    if name == "smollm2-135m":
        with running_server(smollm_engine, name) as srv:
            yield sdk_client(srv.base_url), name
        return
    with engine_for(name) as engine, running_server(engine, name) as srv:
        yield sdk_client(srv.base_url), name


def _chat(client: openai.OpenAI, model: str, role: str):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": role, "content": INSTRUCTION}, QUESTION],
        temperature=0,
        max_tokens=8,
        extra_body={"thinking": {"type": "disabled"}},
    )


def _responses(client: openai.OpenAI, model: str, role: str):
    return client.responses.create(
        model=model,
        input=[{"role": role, "content": INSTRUCTION}, QUESTION],
        temperature=0,
        max_output_tokens=8,
        extra_body={"thinking": {"type": "disabled"}},
    )


def test_chat_developer_message_is_rendered_as_system(served):
    client, model = served
    developer, system = _chat(client, model, "developer"), _chat(client, model, "system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content


def test_responses_developer_message_is_rendered_as_system(served):
    client, model = served
    developer, system = _responses(client, model, "developer"), _responses(client, model, "system")
    assert developer.usage.input_tokens == system.usage.input_tokens
    assert developer.output_text == system.output_text


def test_unknown_role_error_names_only_client_roles(served):
    client, model = served
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, model, "narrator")
    message = e.value.body["message"]
    assert "latest_reminder" not in message
    assert all(role in message for role in ("system", "developer", "user", "assistant", "tool"))
