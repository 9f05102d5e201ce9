"""Test helper (not a test): a real Redis Cluster on loopback, 3 masters and 3 replicas.

Six `redis-server --cluster-enabled yes` processes on free ports, joined by
`redis-cli --cluster create ... --cluster-replicas 1`; a short node timeout so a killed master
fails over in a couple of seconds. Nothing persists; every node and its folder go at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

NODE_TIMEOUT_MS = 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    port: int
    bus_port: int  # given, since the default (port + 10000) may be taken or out of range
    folder: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--cluster-enabled", "yes",
                "--cluster-port", str(self.bus_port),
                "--cluster-config-file", str(self.folder / "nodes.conf"),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                # A replica promotes itself however long ago it last heard from its master.
                "--cluster-replica-validity-factor", "0",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.folder),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            self.proc.wait(10)


@dataclass
class Cluster:
    nodes: list[Node]
    folder: Path
    killed: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.alive()]

    def masters(self) -> list[Node]:
        """Nodes that are masters now, as a live node sees the cluster."""
        info = self.alive()[0].client().cluster("nodes")
        ports = {
            int(addr.split(":")[1].split("@")[0])
            for addr, v in info.items()
            if "master" in v["flags"] and "fail" not in v["flags"]
        }
        return [n for n in self.alive() if n.port in ports]

    def keys_per_master(self, prefix: str) -> dict[int, int]:
        """How many keys with `prefix` each live master holds (SCAN on each)."""
        return {
            n.port: sum(1 for _ in n.client().scan_iter(match=prefix + "*", count=1000))
            for n in self.masters()
        }

    def wait_replicas_in_sync(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(_replica_in_sync(n) for n in self.alive()):
                return True
            time.sleep(0.1)
        return False

    def kill_master(self) -> Node:
        victim = self.masters()[0]
        victim.kill()
        self.killed.append(victim)
        return victim

    def wait_healthy(self, timeout: float = 30.0) -> bool:
        """True once the cluster state is ok with three reachable masters covering all slots."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, IndexError):
                live = self.alive()[0].client()
                if live.cluster("info")["cluster_state"] == "ok" and len(self.masters()) == 3:
                    return True
            time.sleep(0.2)
        return False


def _replica_in_sync(node: Node) -> bool:
    info = node.client().info("replication")
    return info["role"] == "master" or info.get("master_link_status") == "up"


def _wait_answers(node: Node, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            if node.client().ping():
                return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {node.port} did not answer")


@contextlib.contextmanager
def redis_cluster(masters: int = 3, replicas_per_master: int = 1) -> Iterator[Cluster]:
    folder = Path(tempfile.mkdtemp(prefix="deepserve-redis-cluster-"))
    nodes = []
    for _ in range(masters * (1 + replicas_per_master)):
        port = free_port()
        (folder / str(port)).mkdir()
        nodes.append(Node(port, free_port(), folder / str(port)))
    try:
        for n in nodes:
            n.start()
        for n in nodes:
            _wait_answers(n)
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addrs]
            + ["--cluster-replicas", str(replicas_per_master), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        cluster = Cluster(nodes, folder)
        if not (cluster.wait_healthy() and cluster.wait_replicas_in_sync()):
            raise RuntimeError("the Redis Cluster did not reach state ok")
        yield cluster
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(folder, ignore_errors=True)
