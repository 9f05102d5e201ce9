"""`PrefixIndex`: which worker holds which KV blocks, rebuilt from the workers' block events.

Each stored event names a block by key, its parent's key and its token ids, so the index is a tree
of token blocks keyed by (parent key, token ids) and needs no knowledge of how keys are hashed. A
request matches by walking its whole token sequence block by block. Memory is bounded: beyond
`max_blocks` the oldest entries are forgotten (a stale index only costs a cache miss).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from deepserve.disagg.protocol import BlockEvent


@dataclass
class _Block:
    parent: str | None
    tokens: tuple[int, ...]
    holders: set[str] = field(default_factory=set)


class PrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[str, _Block] = OrderedDict()
        self._children: dict[tuple[str | None, tuple[int, ...]], str] = {}
        self._by_worker: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, worker_id: str, events: list[BlockEvent]) -> None:
        for ev in events:
            if ev.kind == "stored":
                self._store(worker_id, ev)
            elif ev.kind == "removed":
                self._remove(worker_id, ev.key)
            elif ev.kind == "cleared":
                self.drop_worker(worker_id)

    def drop_worker(self, worker_id: str) -> None:
        for key in self._by_worker.pop(worker_id, set()):
            self._unhold(worker_id, key)

    def held(self, worker_id: str) -> int:
        """How many blocks the worker's device cache holds, as far as the events tell."""
        return len(self._by_worker.get(worker_id, ()))

    def match(self, token_ids: list[int], block_size: int) -> dict[str, int]:
        """Tokens of `token_ids`' longest cached prefix, per worker that holds any of it."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        parent: str | None = None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            key = self._children.get((parent, tuple(token_ids[start : start + block_size])))
            if key is None:
                break
            holders = self._blocks[key].holders
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for w in alive:
                matched[w] = start + block_size
            parent = key
        return matched

    def _store(self, worker_id: str, ev: BlockEvent) -> None:
        block = self._blocks.get(ev.key)
        if block is None:
            block = _Block(ev.parent, tuple(ev.token_ids))
            self._blocks[ev.key] = block
            self._children[(block.parent, block.tokens)] = ev.key
            self._trim()
        else:
            self._blocks.move_to_end(ev.key)
        block.holders.add(worker_id)
        self._by_worker.setdefault(worker_id, set()).add(ev.key)

    def _remove(self, worker_id: str, key: str) -> None:
        held = self._by_worker.get(worker_id)
        if held is not None and key in held:
            held.discard(key)
            self._unhold(worker_id, key)

    def _unhold(self, worker_id: str, key: str) -> None:
        block = self._blocks.get(key)
        if block is None:
            return
        block.holders.discard(worker_id)
        if not block.holders:
            self._forget(key)

    def _forget(self, key: str) -> None:
        block = self._blocks.pop(key)
        if self._children.get((block.parent, block.tokens)) == key:
            del self._children[(block.parent, block.tokens)]
        for w in block.holders:
            self._by_worker.get(w, set()).discard(key)

    def _trim(self) -> None:
        while len(self._blocks) > self.max_blocks:
            self._forget(next(iter(self._blocks)))
