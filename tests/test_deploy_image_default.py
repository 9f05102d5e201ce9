"""The image's default command and HEALTHCHECK, run natively: `deepserve serve` as the Dockerfile's
CMD starts it (host and port mapped to loopback), the healthcheck script passes against it, and its
/metrics carries the engine's own series next to the request ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from deploy_compose import DOCKER_DIR, HEALTHCHECK_SCRIPT, free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _dockerfile_cmd() -> list[str]:
    for line in (DOCKER_DIR / "Dockerfile").read_text().splitlines():
        if line.startswith("CMD "):
            return json.loads(line[len("CMD ") :])
    raise AssertionError("Dockerfile has no CMD")


def _healthy(port: int) -> bool:
    env = {**os.environ, "DEEPSERVE_HEALTH_URL": f"http://127.0.0.1:{port}/health"}
    result = subprocess.run([sys.executable, str(HEALTHCHECK_SCRIPT)], env=env, capture_output=True)
    return result.returncode == 0


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[int]:
    port = free_port()
    argv = _dockerfile_cmd()
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "deepserve"), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: _healthy(port), 300, "deepserve serve", proc)
        yield port
    except Exception:
        print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _samples(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + json.dumps({k: v for k, v in s.labels.items() if k == "tier"})
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_default_command_is_unhealthy_until_it_listens_then_healthy(served):
    assert _healthy(served)
    assert not _healthy(free_port())


def test_default_command_exports_engine_and_request_metrics(served):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served}/v1", api_key="x", max_retries=0)
    for _ in range(2):  # the second time, the prompt's blocks are in the device cache
        client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=4,
            temperature=0,
        )
    samples = _samples(served)
    assert samples["deepserve:num_preemptions_total{}"] == 0
    assert samples["deepserve:spec_decode_num_draft_tokens_total{}"] == 0
    assert samples["deepserve:request_queue_time_seconds_count{}"] == 2
    assert samples["deepserve:time_to_first_token_seconds_count{}"] == 2
    assert samples['deepserve:cached_prompt_tokens_total{"tier": "device"}'] > 0
    assert samples['deepserve:cached_prompt_tokens_total{"tier": "store"}'] == 0
