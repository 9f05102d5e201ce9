"""The compose stack, run natively: docker/docker-compose.yml's redis, prefill worker, two decode
workers and frontend started as local processes with the same commands, arguments and environment
(hostnames mapped to 127.0.0.1, free ports), and a real Prometheus running docker/prometheus.yml
rewritten to those loopback targets. Checks that requests go through the prefill and a decode
worker, that every target is up, that every PromQL query of the Grafana dashboard returns data,
and that docs/metrics.md lists exactly the metrics the processes expose."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import yaml
from deploy_compose import (
    DASHBOARD_FILE,
    DOCKER_DIR,
    PROMETHEUS_FILE,
    REPO,
    STORE_VOLUME,
    LocalService,
    free_port,
    http_ok,
    load_compose,
    local_topology,
    read_secret,
    redis_ping,
    run_healthcheck,
    volume_folder,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus"),
]

MODEL = "smollm2-135m"
START_TIMEOUT_S = 300
SCRAPE_INTERVAL_S = 1
RATE_WINDOW = "1m"
METRICS_DOC = REPO / "docs" / "metrics.md"
FRONTEND = 'job="deepserve-frontend"'
WORKERS = 'job=~"deepserve-(prefill|decode)"'


@dataclass
class Stack:
    services: dict[str, LocalService]
    procs: dict[str, subprocess.Popen]
    prometheus_url: str
    secrets: Path  # the local stand-in for the compose `secrets` volume (every secret)

    @property
    def frontend(self) -> LocalService:
        return self.services["frontend"]

    def client(self) -> openai.OpenAI:
        key = read_secret(self.secrets, "api_key")
        return openai.OpenAI(base_url=f"{self.frontend.url}/v1", api_key=key, max_retries=0)

    def worker_metrics(self, name: str) -> dict[str, float]:
        return scrape(self.services[name])


def _start(service: LocalService, logs: Path) -> subprocess.Popen:
    log = open(logs / f"{service.name}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        service.argv,
        env={**os.environ, **service.env},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=logs,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _wait_ready(service: LocalService, proc: subprocess.Popen, password: str) -> None:
    if service.name == "redis":
        check = lambda: redis_ping(service.port, password)  # noqa: E731
    else:
        check = lambda: run_healthcheck(service)  # noqa: E731 - the compose healthcheck
    wait_until(check, START_TIMEOUT_S, service.name, proc)


def prometheus_config(services: dict[str, LocalService], prometheus_port: int) -> str:
    """docker/prometheus.yml with compose service targets rewritten to their loopback ports."""
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    # Rule files sit next to prometheus.yml in the repo, mounted under /etc/prometheus in compose.
    config["rule_files"] = [str(DOCKER_DIR / Path(f).name) for f in config.get("rule_files", [])]
    config["global"]["scrape_interval"] = f"{SCRAPE_INTERVAL_S}s"
    config["global"]["evaluation_interval"] = f"{SCRAPE_INTERVAL_S}s"
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            static["targets"] = [
                _loopback_target(t, services, prometheus_port) for t in static["targets"]
            ]
    return yaml.safe_dump(config)


def _loopback_target(target: str, services: dict[str, LocalService], prom_port: int) -> str:
    host = target.rsplit(":", 1)[0]
    port = prom_port if host == "localhost" else services[host].port
    return f"127.0.0.1:{port}"


def _start_prometheus(
    services: dict[str, LocalService], work: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = work / "prometheus.yml"
    config.write_text(prometheus_config(services, port))
    argv = [
        shutil.which("prometheus") or "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={work / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    proc = subprocess.Popen(
        argv,
        stdout=open(work / "prometheus.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(f"{url}/-/ready"), 60, "prometheus", proc)
    return proc, url


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("compose")
    services = {
        s.name: s
        for s in local_topology(load_compose(), Path(sys.executable).parent, data_dir=work)
    }
    store = volume_folder(work, STORE_VOLUME)
    password = read_secret(store, "redis_password")
    procs: dict[str, subprocess.Popen] = {}
    try:
        for service in services.values():
            procs[service.name] = _start(service, work)
            _wait_ready(service, procs[service.name], password)
        procs["prometheus"], prom_url = _start_prometheus(services, work)
        yield Stack(services, procs, prom_url, store)
    except Exception:
        for log in sorted(work.glob("*.log")):
            print(f"---- {log.name}\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
        raise
    finally:
        for proc in reversed(list(procs.values())):
            _stop(proc)


# ---- scraping helpers -----------------------------------------------------------------------


def scrape_text(service: LocalService) -> str:
    with urllib.request.urlopen(f"{service.url}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape(service: LocalService) -> dict[str, float]:
    """Sample name -> value summed over label sets, from one process's /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape_text(service)):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def exposed_metrics(service: LocalService) -> set[str]:
    """Metric names as docs/metrics.md spells them: counters with `_total`, histograms bare."""
    out = set()
    for family in text_string_to_metric_families(scrape_text(service)):
        # prometheus_client also exposes each counter's and histogram's `_created` timestamps.
        if family.name.startswith("deepserve:") and not family.name.endswith("_created"):
            out.add(family.name + "_total" if family.type == "counter" else family.name)
    return out


def promql(stack: Stack, expr: str) -> list[dict]:
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{stack.prometheus_url}/api/v1/query?{query}", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"].replace("$__rate_interval", RATE_WINDOW)))
    return out


# ---- traffic --------------------------------------------------------------------------------


def chat(stack: Stack, content: str, **extra) -> openai.types.chat.ChatCompletion:
    request = {"max_tokens": 16, "temperature": 0, **extra}
    return stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **request
    )


def stream_response(stack: Stack, text: str) -> list[str]:
    events = stack.client().responses.create(
        model=MODEL, input=text, max_output_tokens=16, temperature=0, stream=True
    )
    return [event.type for event in events]


def _counter(metrics: dict[str, float], name: str) -> float:
    return metrics.get(name, 0.0)


# ---- tests ----------------------------------------------------------------------------------


def test_every_service_passes_its_compose_healthcheck(stack):
    for name, service in stack.services.items():
        if name != "redis":
            assert run_healthcheck(service), name


def test_chat_completion_goes_through_prefill_and_a_decode_worker(stack):
    before = {n: stack.worker_metrics(n) for n in ("prefill", "decode-1", "decode-2")}
    reply = chat(stack, "Name three colours.")
    after = {n: stack.worker_metrics(n) for n in ("prefill", "decode-1", "decode-2")}

    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0
    prompt = "deepserve:prompt_tokens_total"
    generated = "deepserve:generation_tokens_total"
    assert _counter(after["prefill"], prompt) > _counter(before["prefill"], prompt)
    decoded = sum(
        _counter(after[n], generated) - _counter(before[n], generated)
        for n in ("decode-1", "decode-2")
    )
    assert decoded > 0


def test_streamed_response_goes_through_prefill_and_a_decode_worker(stack):
    before = {n: stack.worker_metrics(n) for n in ("prefill", "decode-1", "decode-2")}
    types = stream_response(stack, "Write one sentence about the sea.")
    after = {n: stack.worker_metrics(n) for n in ("prefill", "decode-1", "decode-2")}

    assert types[0] == "response.created"
    assert "response.output_text.delta" in types
    # "incomplete" when max_output_tokens ran out first: still the terminal event of a stream.
    assert types[-1] in {"response.completed", "response.incomplete"}
    prompt = "deepserve:prompt_tokens_total"
    generated = "deepserve:generation_tokens_total"
    assert _counter(after["prefill"], prompt) > _counter(before["prefill"], prompt)
    decoded = sum(
        _counter(after[n], generated) - _counter(before[n], generated)
        for n in ("decode-1", "decode-2")
    )
    assert decoded > 0


def _mixed_traffic(stack: Stack) -> None:
    """Enough kinds of request that every dashboard panel has something to show: plain and
    streamed chat, a structured output, a repeated prompt (prefix hits), and a client error."""
    for i in range(4):
        chat(stack, f"Count from {i} to {i + 5}.")
    chat(stack, "Count from 0 to 5.")
    stream_response(stack, "Say hello.")
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    chat(
        stack,
        "Give a colour as JSON.",
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    with pytest.raises(openai.BadRequestError):
        chat(stack, "x", temperature=-1)


def _wait_for_scrapes(stack: Stack) -> None:
    """Rates need two samples after the traffic: wait for a few scrape intervals, then until
    Prometheus has seen the frontend's latest request count."""
    expected = scrape(stack.frontend).get("deepserve:http_requests_total", 0.0)
    time.sleep(3 * SCRAPE_INTERVAL_S)

    def seen() -> bool:
        rows = promql(stack, 'sum(deepserve:http_requests_total{job="deepserve-frontend"})')
        return bool(rows) and float(rows[0]["value"][1]) >= expected

    wait_until(seen, 30, "prometheus scrapes after traffic")


@pytest.fixture(scope="module")
def scraped(stack: Stack) -> Stack:
    """The stack after the mixed traffic, once Prometheus has scraped it."""
    _mixed_traffic(stack)
    _wait_for_scrapes(stack)
    return stack


def test_every_prometheus_target_is_up(scraped):
    stack = scraped
    with urllib.request.urlopen(f"{stack.prometheus_url}/api/v1/targets", timeout=10) as r:
        targets = json.load(r)["data"]["activeTargets"]
    jobs = {t["labels"]["job"] for t in targets}
    assert {"deepserve-frontend", "deepserve-prefill", "deepserve-decode"} <= jobs
    assert len(targets) == 5
    for target in targets:
        assert target["health"] == "up", (target["scrapeUrl"], target.get("lastError"))


def test_alert_rules_evaluate_and_none_fires_on_a_healthy_stack(scraped):
    with urllib.request.urlopen(f"{scraped.prometheus_url}/api/v1/rules", timeout=10) as r:
        groups = json.load(r)["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) >= 5
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        assert rule["state"] != "firing", rule["name"]


def test_every_dashboard_query_returns_series_after_traffic(scraped):
    stack = scraped
    empty = [(title, expr) for title, expr in dashboard_queries() if not promql(stack, expr)]
    assert not empty, "queries with no series:\n" + "\n".join(f"{t}: {e}" for t, e in empty)


# After the traffic above, each of these must have moved (a series that exists but stays at zero
# would pass the dashboard check while its panel shows nothing real).
MOVED = [
    f"sum(deepserve:time_to_first_token_seconds_count{{{FRONTEND}}})",
    f"sum(deepserve:inter_token_latency_seconds_count{{{FRONTEND}}})",
    f"sum(deepserve:e2e_request_latency_seconds_count{{{FRONTEND}}})",
    f'sum(deepserve:http_requests_total{{{FRONTEND}, status="400"}})',
    f"sum(deepserve:structured_output_requests_total{{{FRONTEND}}})",
    f"sum(deepserve:cached_prompt_tokens_total{{{FRONTEND}}})",
    'sum(deepserve:router_requests_total{worker_role="prefill"})',
    'sum(deepserve:router_requests_total{worker_role="decode"})',
    f"sum(deepserve:request_queue_time_seconds_count{{{WORKERS}}})",
    f"sum(deepserve:grammar_compile_seconds_count{{{WORKERS}}})",
    'sum(deepserve:kv_tier_written_bytes_total{tier="store"})',
    'sum(deepserve:pd_transfer_seconds_count{job="deepserve-prefill"})',
    'sum(deepserve:pd_transfer_bytes_total{job="deepserve-prefill", direction="sent"})',
    'sum(deepserve:pd_transfer_blocks_total{job="deepserve-decode", outcome="hit"})',
]


def test_traffic_moves_the_metrics_behind_the_panels(scraped):
    stack = scraped
    still = [
        expr for expr in MOVED if not any(float(r["value"][1]) > 0 for r in promql(stack, expr))
    ]
    assert not still, "still zero after traffic:\n" + "\n".join(still)
    healthy = promql(stack, "sum(deepserve:router_worker_healthy)")
    assert float(healthy[0]["value"][1]) == 3


def documented_metrics() -> dict[str, bool]:
    """Metric name -> whether every process with its component must expose it (rows saying
    "only with `--flag`" need a flag the compose stack does not set)."""
    rows = re.findall(r"^\| `(deepserve:[a-z0-9_:]+)`(.*)$", METRICS_DOC.read_text(), re.M)
    return {name: "only with `--" not in rest for name, rest in rows}


def test_metrics_doc_lists_exactly_the_exposed_metrics(stack):
    exposed = set().union(*(exposed_metrics(s) for n, s in stack.services.items() if n != "redis"))
    documented = documented_metrics()
    required = {name for name, always in documented.items() if always}
    assert not exposed - set(documented), f"undocumented: {sorted(exposed - set(documented))}"
    assert not required - exposed, f"documented, never exposed: {sorted(required - exposed)}"
