"""Worker pool bookkeeping: ejection, re-admission, and the re-readable pool file."""

from __future__ import annotations

import os

import pytest

from deepserve.router.pool import HealthPolicy, PoolFileError, WorkerPool, parse_pool_file


class _Client:
    def __init__(self, url: str) -> None:
        self.url = url

    async def close(self) -> None:
        pass


def pool(**kw) -> WorkerPool:
    return WorkerPool.from_urls({"mixed": ["http://a", "http://b"]}, make_client=_Client, **kw)


def test_worker_is_ejected_after_consecutive_failures_only():
    p = pool(health=HealthPolicy(eject_after=3, readmit_after=2))
    a = p.workers()[0]
    p.record_failure(a)
    p.record_failure(a)
    p.record_success(a)  # the streak is broken
    p.record_failure(a)
    p.record_failure(a)
    assert a.healthy
    p.record_failure(a)
    assert not a.healthy
    assert [w.url for w in p.available("mixed")] == ["http://b"]


def test_ejected_worker_is_readmitted_after_consecutive_probe_successes():
    p = pool(health=HealthPolicy(eject_after=1, readmit_after=2))
    a = p.workers()[0]
    p.record_failure(a)
    p.record_probe_success(a)
    assert not a.healthy
    p.record_probe_success(a)
    assert a.healthy


def test_pool_file_adds_and_removes_workers_on_reload(tmp_path):
    f = tmp_path / "pool.yaml"
    f.write_text("decode: [http://d1/]\nprefill: [http://p1]\n")
    p = WorkerPool.from_urls({}, make_client=_Client, file=f)
    assert {(w.role, w.url) for w in p.workers()} == {
        ("decode", "http://d1"),
        ("prefill", "http://p1"),
    }
    f.write_text("decode: [http://d1, http://d2]\n")
    os.utime(f, (1, 1))  # a distinct mtime even within the filesystem's timestamp granularity
    assert p.file_changed() and p.reload()
    assert {w.url for w in p.workers()} == {"http://d1", "http://d2"}


def test_pool_file_rejects_unknown_roles():
    with pytest.raises(PoolFileError, match="unknown role"):
        parse_pool_file("gpu: [http://x]")
