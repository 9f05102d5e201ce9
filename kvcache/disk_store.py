"""A `BlockStore` on a local directory: a second backend that shows the store interface is real,
and a tier for one machine with a fast disk.

One file per key, named by a hash of the key (keys may hold any characters; the block header still
carries the real key, so a hash collision is caught by the codec). Writes go to a temporary file
that is renamed into place, so a reader never sees half a block. A byte cap is enforced by evicting
the least recently used files (reads touch the file's mtime). Faults (disk full, permissions) are
counted and become misses, like every store.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import xxhash

from deepserve.kvcache.metrics import KVCacheMetrics
from deepserve.kvcache.store import BlockStore

_SUFFIX = ".kvb"


class DiskStore(BlockStore):
    def __init__(
        self,
        root: str | Path,
        max_bytes: int,
        metrics: KVCacheMetrics | None = None,
        tier: str = "store",
    ) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._max_bytes = max_bytes
        self._metrics = metrics
        self._tier = tier
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, oldest first
        self._used = 0
        self._scan()

    @property
    def used_bytes(self) -> int:
        return self._used

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            out.append(self._read(self._name(key)))
        n = sum(len(v) for v in out if v is not None)
        if self._metrics is not None and n:
            self._metrics.bytes_in.labels(self._tier).inc(n)
        return out

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [self._name(k) in self._sizes for k in keys]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        written = 0
        for key, value in items:
            if len(value) > self._max_bytes or self.exists_many([key])[0]:
                continue
            if self._write(self._name(key), value):
                written += 1
        return written

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            name = self._name(key)
            with self._lock:
                self._forget(name)
            self._unlink(name)

    def _read(self, name: str) -> bytes | None:
        with self._lock:
            if name not in self._sizes:
                return None
            self._sizes.move_to_end(name)
        path = self._root / name
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            with self._lock:
                self._forget(name)
            return None
        except OSError:
            self._fault("get")
            return None
        return data

    def _write(self, name: str, value: bytes) -> bool:
        try:
            fd, tmp = tempfile.mkstemp(dir=self._root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, self._root / name)
        except OSError:
            self._fault("put")
            return False
        with self._lock:
            self._forget(name)
            self._sizes[name] = len(value)
            self._used += len(value)
            victims = self._evict_locked()
        for victim in victims:
            self._unlink(victim)
        if self._metrics is not None:
            self._metrics.bytes_out.labels(self._tier).inc(len(value))
        return True

    def _evict_locked(self) -> list[str]:
        victims = []
        while self._used > self._max_bytes:
            name, size = self._sizes.popitem(last=False)
            self._used -= size
            victims.append(name)
        if self._metrics is not None and victims:
            self._metrics.evictions.labels(self._tier).inc(len(victims))
        return victims

    def _forget(self, name: str) -> None:
        size = self._sizes.pop(name, None)
        if size is not None:
            self._used -= size

    def _unlink(self, name: str) -> None:
        try:
            (self._root / name).unlink(missing_ok=True)
        except OSError:
            self._fault("delete")

    def _scan(self) -> None:
        """Index the files a previous process left, oldest first; drop its stray temp files."""
        entries = []
        for path in self._root.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
            elif path.suffix == _SUFFIX:
                st = path.stat()
                entries.append((st.st_mtime, path.name, st.st_size))
        for _, name, size in sorted(entries):
            self._sizes[name] = size
            self._used += size
        for victim in self._evict_locked():
            self._unlink(victim)

    @staticmethod
    def _name(key: str) -> str:
        return xxhash.xxh3_128_hexdigest(key.encode()) + _SUFFIX

    def _fault(self, op: str) -> None:
        if self._metrics is not None:
            self._metrics.store_errors.labels(self._tier, op).inc()
