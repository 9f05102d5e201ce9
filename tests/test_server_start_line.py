"""Each listening process logs one start line naming its role, model, kernels and address: what
`docker compose logs` shows of it. `deepserve serve`, `worker` and `frontend` are started as the CLI
starts them, in their own processes, with the CLI's default --log-level."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator

import pytest
from router_cluster import CLI, Proc, free_port, frontend, start_all, stop_all, worker

from deepserve.kernels.registry import kernels_in_use
from deepserve.server.cli import build_parser

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m"
START_LINE = re.compile(
    r"deepserve started: role=(?P<role>\S+) model=(?P<model>\S+) kernels=(?P<kernels>\S+) "
    r"listening on (?P<url>\S+)$"
)


def start_lines(proc: Proc) -> list[dict[str, str]]:
    text = proc.log.read_text(errors="replace")
    return [m.groupdict() for line in text.splitlines() if (m := START_LINE.search(line))]


def expected(proc: Proc, role: str) -> dict[str, str]:
    # The kernels this machine's CPU engine runs (native when the library loads), as the child has.
    return {"role": role, "model": MODEL, "kernels": kernels_in_use("cpu"), "url": proc.url}


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Proc]]:
    prefill, decode = worker("prefill", MODEL, None), worker("decode", MODEL, None)
    procs = {"prefill": prefill, "decode": decode}
    try:
        start_all(prefill, decode)
        procs["frontend"] = frontend(MODEL, prefill=[prefill], decode=[decode])
        start_all(procs["frontend"])
        yield procs
    except Exception:
        for p in procs.values():
            print(f"---- {p.name}\n{p.tail()}", file=sys.stderr)
        raise
    finally:
        stop_all(*procs.values())


def test_serve_logs_one_start_line_with_its_model_kernels_and_address():
    port = free_port()
    serve = Proc("serve", [*CLI, "serve", "--model", MODEL, "--port", str(port)], port, "/health")
    try:
        start_all(serve)
        assert start_lines(serve) == [expected(serve, "serve")]
    finally:
        stop_all(serve)


def test_each_worker_logs_one_start_line_naming_its_role(cluster):
    for role in ("prefill", "decode"):
        assert start_lines(cluster[role]) == [expected(cluster[role], role)], role


def test_the_frontend_logs_one_start_line_with_its_workers_model_and_kernels(cluster):
    assert start_lines(cluster["frontend"]) == [expected(cluster["frontend"], "frontend")]


def test_every_listening_subcommand_logs_at_info_unless_told():
    for command in ("serve", "worker", "frontend"):
        assert build_parser().parse_args([command]).log_level == "info", command
        args = build_parser().parse_args([command, "--log-level", "warning"])
        assert args.log_level == "warning", command
