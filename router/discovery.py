"""`DnsDiscovery`: workers found by resolving DNS names, refreshed on an interval.

On Kubernetes a headless Service's name resolves to one A (or AAAA) record per ready pod, so
`--discover decode=http://deepserve-decode:8100` makes the decode pool follow the Deployment as it
scales or as pods come and go, without a restart. Each refresh resolves every name, turns each
address into a worker URL with the name's scheme and port, and hands the result to the pool, which
adds and retires workers as it does for a changed pool file (router/pool.py).

A name that does not exist or has no records is an empty role (the Service has no ready pod);
any other resolver failure (timeout, server error) keeps the addresses of the last good answer,
so a DNS hiccup never empties the pool.

Resolution goes through the system resolver (getaddrinfo: /etc/hosts, search domains, the
cluster DNS), or, given `dns_server`, straight to that server with dnspython.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from deepserve.disagg.background import BackgroundTask
from deepserve.router.pool import ROLES, WorkerPool

log = logging.getLogger(__name__)


class NameNotFound(Exception):
    """The name has no address records (NXDOMAIN or an empty answer)."""


Resolver = Callable[[str], Awaitable[list[str]]]  # host name -> addresses; raises NameNotFound


@dataclass(frozen=True)
class DiscoveryTarget:
    role: str
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, spec: str) -> DiscoveryTarget:
        """`ROLE=SCHEME://NAME:PORT`, e.g. `decode=http://deepserve-decode:8100`."""
        role, sep, url = spec.partition("=")
        parts = urlsplit(url)
        if not sep or role not in ROLES or not parts.hostname or not parts.port:
            raise ValueError(f"discovery target {spec!r} is not ROLE=http://NAME:PORT")
        return cls(role, parts.scheme or "http", parts.hostname, parts.port)

    def url(self, address: str) -> str:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return f"{self.scheme}://{host}:{self.port}"


async def system_resolve(host: str) -> list[str]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise NameNotFound(host) from e
        raise
    return sorted({info[4][0] for info in infos})


def server_resolver(server: str, timeout_s: float = 2.0) -> Resolver:
    """A resolver that asks the DNS server at `server` (HOST or HOST:PORT) for A and AAAA."""
    import dns.asyncresolver
    import dns.resolver

    host, _, port = server.rpartition(":") if ":" in server else (server, "", "53")
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = int(port)
    resolver.lifetime = timeout_s

    async def resolve(name: str) -> list[str]:
        found: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await resolver.resolve(name, rdtype)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            found.update(r.address for r in answer)
        if not found:
            raise NameNotFound(name)
        return sorted(found)

    return resolve


class DnsDiscovery:
    def __init__(
        self,
        pool: WorkerPool,
        targets: list[DiscoveryTarget],
        resolve: Resolver = system_resolve,
        interval: float = 5.0,
    ) -> None:
        self.pool = pool
        self.targets = targets
        self.resolve = resolve
        self.interval = interval
        self._last: dict[DiscoveryTarget, list[str]] = {}  # last good answer per target
        self._refresher = BackgroundTask(self._run, "router-dns-discovery")

    def start(self) -> None:
        self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()

    async def refresh(self) -> bool:
        """Resolve every name once and update the pool; True when the worker set changed."""
        for target in self.targets:
            await self._resolve_one(target)
        urls: dict[str, list[str]] = {}
        for target, addresses in self._last.items():
            urls.setdefault(target.role, []).extend(target.url(a) for a in addresses)
        changed = self.pool.set_discovered(urls)
        if changed:
            log.warning("discovered workers: %s", urls)
        await self.pool.close_idle_retired()
        return changed

    async def _resolve_one(self, target: DiscoveryTarget) -> None:
        try:
            self._last[target] = await self.resolve(target.host)
        except NameNotFound:
            self._last[target] = []
        except Exception as e:  # noqa: BLE001 - any resolver fault keeps the last good answer
            log.warning(
                "resolving %s failed (%s); keeping %s", target.host, e, self._last.get(target)
            )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.refresh()
