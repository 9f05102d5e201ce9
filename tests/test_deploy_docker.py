"""The compose stack for real, with a Docker daemon: builds the image, starts the whole stack with
`docker compose up -d --wait`, checks it through the published ports and `docker compose exec`,
then `docker compose down -v`.

Needs `docker info` to succeed and Docker Compose v2.20+; skipped, with the reason, where it does
not (CI has no daemon). Where no registry is reachable, ../shared/docker-sandbox/setup.sh gives a
daemon and local base images. Runs as its own compose project on free host ports, so it never
touches a stack a person has up. The first build takes minutes (README, Docker section).
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from deploy_compose import REPO, SECRETS_MOUNT, free_port
from prometheus_client.parser import text_string_to_metric_families

PROJECT = "deepserve-test"
IMAGE = "deepserve:cpu"
MODEL = "smollm2-135m"
WORKERS = ("prefill", "decode-1", "decode-2")
DEEPSERVE_SERVICES = (*WORKERS, "frontend")
# Each secret, and a service that holds it (each service holds only its own).
SECRET_HOLDERS = {
    "api_key": "frontend",
    "internal_token": "frontend",
    "redis_password": "redis",
    "kv_secret": "prefill",
    "grafana_admin_password": "grafana",
}
MAX_IMAGE_BYTES = 1_200_000_000
BUILD_TIMEOUT_S = 1800
UP_TIMEOUT_S = 900


def _no_docker_reason() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return f"`docker info` failed: {lines[-1] if lines else info.returncode}"
    version = subprocess.run(
        ["docker", "compose", "version", "--short"], capture_output=True, text=True, timeout=60
    )
    if version.returncode != 0:
        return "Docker Compose v2 (`docker compose`) is not installed"
    return None


NO_DOCKER = _no_docker_reason()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(BUILD_TIMEOUT_S + UP_TIMEOUT_S + 900),
    pytest.mark.skipif(NO_DOCKER is not None, reason=f"needs a Docker daemon: {NO_DOCKER}"),
]


@dataclass
class Stack:
    env: dict[str, str]
    port: int
    prometheus_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 300, check: bool = True):
        return compose(self.env, *args, timeout=timeout, check=check)

    def secret(self, name: str, service: str = "frontend") -> str:
        return self.compose("exec", "-T", service, "cat", f"{SECRETS_MOUNT}/{name}").stdout.strip()

    def secret_files(self, service: str) -> dict[str, str]:
        """File name -> "mode owner" of the secrets a service's container holds."""
        listing = self.compose(
            "exec", "-T", service, "sh", "-c", f"cd {SECRETS_MOUNT} && stat -c '%n %a %u' *"
        ).stdout
        return {name: rest for name, _, rest in (ln.partition(" ") for ln in listing.splitlines())}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.secret("api_key"), max_retries=0, timeout=600
        )

    def inside(self, service: str, url: str) -> tuple[int, str]:
        """GET `url` from inside a service's container: workers publish no port."""
        script = (
            "import sys, urllib.request, urllib.error\n"
            "try:\n"
            "    r = urllib.request.urlopen(sys.argv[1], timeout=10)\n"
            "    print(r.status, r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code, e.read().decode())\n"
        )
        out = self.compose("exec", "-T", service, "python", "-c", script, url).stdout
        status, _, body = out.strip().partition(" ")
        return int(status), body

    def container_ids(self) -> list[str]:
        return self.compose("ps", "-a", "-q").stdout.split()


def compose(env: dict[str, str], *args: str, timeout: float = 300, check: bool = True):
    argv = ["docker", "compose", "-f", str(REPO / "compose.yaml"), "-p", PROJECT, *args]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {result.returncode}\n{result.stderr[-4000:]}")
    return result


def _timed(what: str, fn) -> None:
    start = time.monotonic()
    fn()
    print(f"\n[docker] {what}: {time.monotonic() - start:.0f} s", flush=True)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    import os

    ports = {name: free_port() for name in ("app", "prometheus", "grafana")}
    env = {
        **os.environ,
        "DEEPSERVE_PORT": str(ports["app"]),
        "DEEPSERVE_PROMETHEUS_PORT": str(ports["prometheus"]),
        "DEEPSERVE_GRAFANA_PORT": str(ports["grafana"]),
    }
    s = Stack(env, ports["app"], ports["prometheus"])
    try:
        _timed("docker compose build", lambda: s.compose("build", timeout=BUILD_TIMEOUT_S))
        _timed(
            "docker compose up -d --wait",
            lambda: s.compose(
                "up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S), timeout=UP_TIMEOUT_S + 60
            ),
        )
        yield s
    except BaseException:
        print(s.compose("logs", "--no-color", "--tail", "40", check=False).stdout[-12000:])
        raise
    finally:
        _timed("docker compose down -v", lambda: s.compose("down", "-v", timeout=300))
        left = subprocess.run(
            [
                "docker",
                "volume",
                "ls",
                "-q",
                "--filter",
                f"label=com.docker.compose.project={PROJECT}",
            ],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert not left, f"volumes left after down -v: {left}"


def _frontend_counter(stack: Stack, name: str) -> float:
    with urllib.request.urlopen(f"{stack.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def _chat(client: openai.OpenAI, content: str, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        **{"max_tokens": 16, "temperature": 0, **extra},
    )


# ---- the image --------------------------------------------------------------------------------


def test_image_is_at_most_1_2_gb(stack):
    size = int(
        subprocess.run(
            ["docker", "image", "inspect", IMAGE, "-f", "{{.Size}}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    print(f"\n[docker] {IMAGE}: {size / 1e9:.3f} GB", flush=True)
    assert size <= MAX_IMAGE_BYTES


def test_every_deepserve_container_exposes_only_the_port_it_listens_on(stack):
    listening = {"frontend": "8000/tcp", **{w: "8100/tcp" for w in WORKERS}}
    for service, port in listening.items():
        (container,) = stack.compose("ps", "-q", service).stdout.split()
        exposed = subprocess.run(
            ["docker", "inspect", container, "-f", "{{json .Config.ExposedPorts}}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # A port without a protocol is TCP (Docker 20.10 stores compose's `expose` entries so).
        ports = {p if "/" in p else f"{p}/tcp" for p in json.loads(exposed)}
        assert ports == {port}, service


def test_every_deepserve_container_runs_as_the_image_user_without_a_compiler(stack):
    for service in DEEPSERVE_SERVICES:
        probe = "id -u; command -v c++ g++ gcc cc || true"
        out = stack.compose("exec", "-T", service, "sh", "-c", probe).stdout.split()
        assert out == ["10001"], f"{service}: {out}"


def test_native_kernels_load_in_every_deepserve_container(stack):
    script = "from deepserve.kernels.cpu import native; print(native.load())"
    for service in DEEPSERVE_SERVICES:
        result = stack.compose("exec", "-T", service, "python", "-c", script)
        assert result.stdout.split() == ["True"], f"{service}: {result.stderr[-2000:]}"
        assert "unavailable" not in result.stderr, service
        logs = stack.compose("logs", "--no-color", service).stdout
        assert "native CPU kernels unavailable" not in logs, service


def test_every_deepserve_container_logs_one_start_line(stack):
    roles = {"prefill": "prefill", "decode-1": "decode", "decode-2": "decode"}
    roles["frontend"] = "frontend"
    for service, role in roles.items():
        logs = stack.compose("logs", "--no-color", service).stdout
        lines = [line for line in logs.splitlines() if "deepserve started:" in line]
        assert len(lines) == 1, f"{service}: {lines}"
        assert f"role={role} model={MODEL} kernels=native listening on http://0.0.0.0:" in lines[0]


def test_every_worker_reports_native_kernels_on_its_open_health(stack):
    for service in WORKERS:
        status, body = stack.inside(service, "http://127.0.0.1:8100/health")
        assert status == 200, service
        assert json.loads(body) == {"status": "ok", "kernels": "native"}, service


# ---- every process: open health, guarded internals ----------------------------------------


def test_every_process_answers_open_health_and_ready(stack):
    ports = {"frontend": 8000, **{w: 8100 for w in WORKERS}}
    for service, port in ports.items():
        for path in ("/health", "/ready"):
            status, _ = stack.inside(service, f"http://127.0.0.1:{port}{path}")
            assert status == 200, f"{service}{path}"
    for service in WORKERS:
        status, _ = stack.inside(service, "http://127.0.0.1:8100/internal/health")
        assert status == 401, service


def test_the_api_needs_the_generated_key(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30).status_code == 401
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200


# ---- traffic through the published port -------------------------------------------------------


def test_chat_completion_answers(stack):
    reply = _chat(stack.client(), "Name three colours.")
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_chat_completion_streams(stack):
    chunks = list(_chat(stack.client(), "Write one sentence about the sea.", stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_repeated_long_prompt_is_served_from_the_prefix_cache(stack):
    prompt = "Summarise these notes. " + " ".join(
        f"note {i}: item {i * 7 % 13}." for i in range(200)
    )
    client = stack.client()
    name = "deepserve:cached_prompt_tokens_total"
    before = _frontend_counter(stack, name)
    start = time.monotonic()
    first = _chat(client, prompt, max_tokens=4)
    cold = time.monotonic() - start
    start = time.monotonic()
    again = _chat(client, prompt, max_tokens=4)
    warm = time.monotonic() - start
    rise = _frontend_counter(stack, name) - before
    cached = again.usage.prompt_tokens_details.cached_tokens
    print(
        f"\n[docker] {first.usage.prompt_tokens}-token prompt: {cold:.2f} s cold, {warm:.2f} s "
        f"repeated ({cached} tokens cached; metric +{rise:.0f})",
        flush=True,
    )
    assert first.usage.prompt_tokens > 1000
    assert cached >= first.usage.prompt_tokens - 16
    assert rise >= cached


def test_every_prometheus_target_is_up(stack):
    url = f"http://127.0.0.1:{stack.prometheus_port}/api/v1/targets"
    deadline = time.monotonic() + 120
    while True:
        with urllib.request.urlopen(url, timeout=10) as r:
            targets = json.load(r)["data"]["activeTargets"]
        health = {t["scrapeUrl"]: t["health"] for t in targets}
        if (len(health) == 5 and set(health.values()) == {"up"}) or time.monotonic() > deadline:
            break
        time.sleep(2)
    print(f"\n[docker] prometheus targets: {health}", flush=True)
    assert len(health) == 5 and set(health.values()) == {"up"}, health


# ---- secrets ----------------------------------------------------------------------------------


def test_deepserve_and_redis_containers_hold_only_their_own_secrets_owner_only(stack):
    expected = {
        "frontend": {"api_key", "internal_token", "redis_password"},
        **{w: {"internal_token", "redis_password", "kv_secret"} for w in WORKERS},
        "redis": {"redis_password", "redis.conf"},
    }
    for service, names in expected.items():
        files = stack.secret_files(service)
        assert set(files) == names, service
        assert set(files.values()) == {"400 10001"}, f"{service}: {files}"


def test_redis_runs_as_the_deepserve_image_uid(stack):
    assert stack.compose("exec", "-T", "redis", "id", "-u").stdout.split() == ["10001"]


def test_grafana_holds_only_its_admin_password(stack):
    assert set(stack.secret_files("grafana")) == {"grafana_admin_password"}


def test_no_secret_appears_in_ps_or_docker_inspect(stack):
    secrets = [stack.secret(name, service).strip() for name, service in SECRET_HOLDERS.items()]
    assert all(len(s) >= 32 for s in secrets)
    ps = subprocess.run(["ps", "-e", "-ww", "-o", "args"], capture_output=True, text=True).stdout
    ps_env = subprocess.run(["ps", "eww", "-e"], capture_output=True, text=True).stdout
    inspect = subprocess.run(
        ["docker", "inspect", *stack.container_ids()], capture_output=True, text=True, check=True
    ).stdout
    image = subprocess.run(
        ["docker", "image", "inspect", IMAGE], capture_output=True, text=True, check=True
    ).stdout
    assert "redis-server" in ps and "deepserve" in inspect  # the places searched are the right ones
    for name, value in zip(SECRET_HOLDERS, secrets, strict=True):
        for where, text in (("ps", ps), ("ps e", ps_env), ("inspect", inspect), ("image", image)):
            assert value not in text, f"{name} shows in {where}"


# ---- last: a decode container dies under load -------------------------------------------------


def test_killing_a_decode_container_mid_load_fails_no_request(stack):
    client = stack.client()
    prompts = [f"Count slowly from {i} to {i + 30}, one number per line." for i in range(24)]

    def one(prompt: str) -> str:
        reply = _chat(client, prompt, max_tokens=48)
        return reply.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        done = 0
        for done, _ in enumerate(concurrent.futures.as_completed(futures), start=1):
            if done == 3:
                stack.compose("kill", "decode-1")
                break
        answers = [f.result() for f in futures]  # raises if any request failed
    print(f"\n[docker] killed decode-1 after {done} of 24 answered; all 24 answered", flush=True)
    assert len(answers) == 24 and all(answers)
