"""Worker discovery by DNS against a real DNS server on loopback (dnslib serving a zone the test
edits; dnspython asks it over UDP): the pool follows a name's A records as they change, a name
that goes away empties its role, a DNS server that stops answering keeps the last workers, and a
real frontend over real workers (each on its own loopback address, one port) keeps serving while
the records move from one worker to the other."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
import router_cluster as rc
from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer
from prometheus_client.parser import text_string_to_metric_families

from deepserve.disagg.client import WorkerClient
from deepserve.router.discovery import (
    DiscoveryTarget,
    DnsDiscovery,
    server_resolver,
    system_resolve,
)
from deepserve.router.pool import WorkerPool

NAME = "deepserve-workers.test"
MODEL = "tiny-deepseek"


class Zone(BaseResolver):
    """A records by name, editable while the server runs; unknown names are NXDOMAIN."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        if name not in self.records:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for address in self.records[name]:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
        return reply


class DnsFixture:
    def __init__(self) -> None:
        self.zone = Zone()
        self.port = rc.free_port()
        self.server = DNSServer(
            self.zone, address="127.0.0.1", port=self.port, logger=DNSLogger(logf=lambda s: None)
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def dns() -> Iterator[DnsFixture]:
    fixture = DnsFixture()
    fixture.server.start_thread()
    yield fixture
    if fixture.server.isAlive():
        fixture.server.stop()


def discovery(dns: DnsFixture, role: str = "decode") -> tuple[WorkerPool, DnsDiscovery]:
    pool = WorkerPool(make_client=lambda url: WorkerClient(url, "token"))
    target = DiscoveryTarget.parse(f"{role}=http://{NAME}:8100")
    return pool, DnsDiscovery(pool, [target], server_resolver(dns.address, timeout_s=0.5))


def urls(pool: WorkerPool, role: str = "decode") -> set[str]:
    return {w.url for w in pool.workers(role)}


async def test_pool_follows_the_names_a_records(dns):
    pool, disc = discovery(dns)
    dns.zone.records[NAME] = ["10.0.0.1", "10.0.0.2"]
    assert await disc.refresh()
    assert urls(pool) == {"http://10.0.0.1:8100", "http://10.0.0.2:8100"}
    dns.zone.records[NAME] = ["10.0.0.2", "10.0.0.3"]
    assert await disc.refresh()
    assert urls(pool) == {"http://10.0.0.2:8100", "http://10.0.0.3:8100"}
    assert not await disc.refresh()  # same answer, nothing changes
    await pool.close()


async def test_a_name_that_goes_away_empties_its_role(dns):
    pool, disc = discovery(dns)
    dns.zone.records[NAME] = ["10.0.0.1"]
    await disc.refresh()
    del dns.zone.records[NAME]
    await disc.refresh()
    assert urls(pool) == set()
    await pool.close()


async def test_a_dns_server_that_stops_answering_keeps_the_last_workers(dns):
    pool, disc = discovery(dns)
    dns.zone.records[NAME] = ["10.0.0.1", "10.0.0.2"]
    await disc.refresh()
    dns.server.stop()
    assert not await disc.refresh()
    assert urls(pool) == {"http://10.0.0.1:8100", "http://10.0.0.2:8100"}
    await pool.close()


async def test_removed_workers_clients_close_once_idle_after_the_grace():
    pool = WorkerPool(make_client=lambda url: WorkerClient(url, "token"))
    pool.set_discovered({"decode": ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]})
    busy, idle = sorted(pool.workers("decode"), key=lambda w: w.url)
    busy.inflight = 1  # a request still streams from it
    pool.set_discovered({"decode": []})
    await pool.close_idle_retired(grace_s=60)
    assert not idle.client._http.is_closed  # within the grace: a probe may still use it
    await pool.close_idle_retired(grace_s=0)
    assert idle.client._http.is_closed and not busy.client._http.is_closed
    busy.inflight = 0
    await pool.close()


async def test_the_system_resolver_reads_the_hosts_file():
    assert "127.0.0.1" in await system_resolve("localhost")


def test_an_ipv6_address_becomes_a_bracketed_url():
    target = DiscoveryTarget.parse("prefill=http://name:8100")
    assert target.url("fd00::5") == "http://[fd00::5]:8100"


def test_discovery_target_rejects_an_unknown_role_or_a_missing_port():
    for spec in ("router=http://name:8100", "decode=http://name", "http://name:8100"):
        with pytest.raises(ValueError):
            DiscoveryTarget.parse(spec)


# ---- a real frontend over real workers -----------------------------------------------------------


def routed(front: rc.Proc) -> dict[str, float]:
    """Requests the frontend's router has sent to each worker URL."""
    text = httpx.get(front.url + "/metrics", timeout=5).text
    return {
        s.labels["worker"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "deepserve:router_requests"
        for s in f.samples
        if s.name.endswith("_total")
    }


def in_pool(front: rc.Proc) -> set[str]:
    text = httpx.get(front.url + "/metrics", timeout=5).text
    return {
        s.labels["worker"]
        for f in text_string_to_metric_families(text)
        if f.name == "deepserve:router_worker_healthy"
        for s in f.samples
    }


class Traffic:
    """Chat requests one after another on a thread until stopped; counts failures."""

    def __init__(self, front: rc.Proc) -> None:
        self.client = openai.OpenAI(
            base_url=front.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        self.done, self.errors = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Say {self.done}."}],
                    max_tokens=3,
                    extra_body={"thinking": {"type": "disabled"}},
                )
                self.done += 1
            except openai.OpenAIError as e:
                self.errors.append(repr(e))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(90)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_frontend_serves_throughout_as_the_records_move_between_workers(dns):
    port = rc.free_port()
    a = rc.worker("mixed", MODEL, None, host="127.0.0.2", port=port)
    b = rc.worker("mixed", MODEL, None, host="127.0.0.3", port=port)
    dns.zone.records[NAME] = [a.host]
    front = rc.frontend(
        MODEL,
        extra=(
            "--discover", f"mixed=http://{NAME}:{port}",
            "--dns-server", dns.address,
            "--discover-interval", "0.2",
            "--health-interval", "0.2",
        ),
    )  # fmt: skip
    try:
        rc.start_all(a, b)
        rc.start_all(front)
        with Traffic(front) as traffic:
            for records in ([a.host, b.host], [b.host], [a.host]):
                dns.zone.records[NAME] = records
                want = {f"http://{h}:{port}" for h in records}
                assert rc.wait_for(lambda want=want: in_pool(front) == want, 30), in_pool(front)
                sent = routed(front)
                assert rc.wait_for(
                    lambda sent=sent, want=want: all(
                        routed(front).get(u, 0) > sent.get(u, 0) for u in want
                    ),
                    60,
                ), f"no request reached every worker of {want}"
        assert traffic.errors == [] and traffic.done > 0
    finally:
        rc.stop_all(front, a, b)
