"""Paged KV memory on the device: refcounted blocks, block tables, and the prefix cache.

The block manager owns which block ids are in use, by whom, and what they hold; it never touches the
KV tensor itself (the model runner does, and kvcache/ tiers move bytes). A sequence's block table
lists its block ids in order; token t of a sequence lives in block `block_table[t // block_size]`.

Prefix caching: every FULL block gets a key = xxh3_128(parent key ‖ its token ids), the first block's
parent being the model fingerprint (salted by the request's `cache_salt`, if any: blocks of
different salts never match), so a key names one exact token prefix. Blocks whose KV is
computed are registered under their key; a later sequence whose leading blocks have the same keys
(and the same token ids: a hash match alone is never trusted) reuses them instead of recomputing.

Free blocks wait in two queues. Blocks without cached content are reused first, newest first (their
contents are worthless, and LIFO keeps the hot set small). Blocks holding cached content are evicted
least-recently-freed first, so the longest-lived prefixes survive. Freeing a sequence releases its
tail blocks first, which keeps a prefix's head in the cache longest.

Hook points for KV tiers (kvcache/): `KVTierHooks.on_evict(key, block_id)` runs before an evicted
block is reused (its bytes are still intact); `on_store(key, block_id)` after a block is registered;
`lookup(keys)` says how many further prefix blocks a lower tier can supply, which are then allocated
here and returned by `take_pending_loads()` for the runner to fill before the forward pass.
Router events: `take_events()` drains `BlockStored` / `BlockRemoved`.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from deepserve.engine.request import Sequence


class KVTierHooks(Protocol):
    """What a lower KV tier plugs in; every method is optional in spirit (may do nothing)."""

    name: str

    def on_evict(self, key: bytes, block_id: int) -> None: ...

    def on_store(self, key: bytes, block_id: int) -> None: ...

    def lookup(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, this tier can supply."""
        ...


@dataclass(frozen=True)
class BlockStored:
    key: bytes
    parent_key: bytes | None
    token_ids: tuple[int, ...]
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    key: bytes
    block_id: int


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixMatch:
    """Result of a prefix lookup: device blocks to reuse and tier keys to load."""

    device_blocks: list[int] = field(default_factory=list)
    tier_keys: list[bytes] = field(default_factory=list)

    def num_blocks(self) -> int:
        return len(self.device_blocks) + len(self.tier_keys)


@dataclass
class CacheStats:
    queries: int = 0  # tokens of sequences admitted with a prefix lookup
    hits: int = 0  # of which served from the device cache
    tier_hits: int = 0  # of which served from a lower tier
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return (self.hits + self.tier_hits) / self.queries if self.queries else 0.0


def block_key(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    return xxhash.xxh3_128_digest(parent + array("I", token_ids).tobytes())


def role_key(parent: bytes, prompt_rows: int) -> bytes:
    """The parent key of a block whose first `prompt_rows` tokens were prompt rows and the rest
    generated ones: blocks of the same tokens computed in other roles never share a key."""
    return xxhash.xxh3_128_digest(parent + b"generated_from\0" + prompt_rows.to_bytes(4, "little"))


def root_key(fingerprint: str, cache_salt: str | None = None) -> bytes:
    """The parent key of a sequence's first block: the model, and the request's salt."""
    root = xxhash.xxh3_128_digest(fingerprint.encode())
    if cache_salt:
        root = xxhash.xxh3_128_digest(root + b"cache_salt\0" + cache_salt.encode())
    return root


def prompt_block_keys(
    fingerprint: str, prompt: list[int], block_size: int, cache_salt: str | None = None
) -> list[str]:
    """Hex keys of the prompt's full blocks, chained as `BlockManager` chains them: what a prefill
    worker hands to the decode worker."""
    keys, parent = [], root_key(fingerprint, cache_salt)
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = block_key(parent, prompt[start : start + block_size])
        keys.append(parent.hex())
    return keys


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        fingerprint: str,
        enable_prefix_caching: bool = True,
        tier: KVTierHooks | None = None,
        role_keys: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.tier = tier
        # True where a token's KV depends on whether it was computed as a prompt or a generated
        # row (MLA under --batch-invariant, `kv_follows_row_role`): a block holding generated
        # tokens is keyed apart, so it is never served to a prompt that holds the same tokens
        self.role_keys = role_keys
        self.fingerprint = fingerprint
        self._root = root_key(fingerprint)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Popped from the end: block 0 comes out first, which keeps tests readable.
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._index: dict[bytes, int] = {}
        self._events: list[BlockStored | BlockRemoved] = []
        self._pending_loads: list[tuple[bytes, int]] = []
        self.stats = CacheStats()

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (free blocks with cached content count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, match: PrefixMatch | None) -> int:
        """Fresh blocks `seq` needs for `num_new_tokens` more tokens (tier loads need fresh ones)."""
        base = seq.num_computed_tokens
        have = len(seq.block_table)
        if match is not None and match.num_blocks():
            base = match.num_blocks() * self.block_size
            have += len(match.device_blocks)
        total = -(-(base + num_new_tokens) // self.block_size)
        return max(0, total - have)

    def can_allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        match: PrefixMatch | None = None,
        extra_blocks: int = 0,
    ) -> bool:
        """Whether `allocate` would succeed with `extra_blocks` more kept free (for forks)."""
        revived = (
            sum(1 for b in match.device_blocks if self.blocks[b].ref_count == 0) if match else 0
        )
        needed = self.blocks_needed(seq, num_new_tokens, match) + revived + extra_blocks
        return needed <= self.num_free_blocks

    # ---- prefix cache lookup --------------------------------------------------------------

    def update_hashes(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` to cover every full block of its token ids."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else self._root_of(seq)
            prompt_rows = seq.num_prompt_tokens - i * bs
            if self.role_keys and prompt_rows < bs:  # the block holds generated rows
                parent = role_key(parent, max(prompt_rows, 0))
            hashes.append(block_key(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def _root_of(self, seq: Sequence) -> bytes:
        salt = seq.request.params.cache_salt
        return root_key(self.fingerprint, salt) if salt else self._root

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Find cached leading blocks for a sequence that holds none. No side effects.

        At most (num_tokens - 1) // block_size blocks match: the last token is always computed,
        because its logits are what the sequence samples from.
        """
        match = PrefixMatch()
        if not self.enable_prefix_caching or seq.block_table:
            return match
        self.update_hashes(seq)
        limit = (seq.num_tokens - 1) // self.block_size
        bs = self.block_size
        for i in range(limit):
            block_id = self._index.get(seq.block_hashes[i])
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            match.device_blocks.append(block_id)
        start = len(match.device_blocks)
        if self.tier is not None and start < limit:
            n = self.tier.lookup(seq.block_hashes[start:limit])
            match.tier_keys = seq.block_hashes[start : start + n]
        return match

    def cached_block(self, key: bytes) -> int | None:
        """The device block holding `key`'s content, held by a sequence or free but cached; None
        once evicted. Valid until the next allocation (call it on the engine thread)."""
        return self._index.get(key)

    # ---- allocation -----------------------------------------------------------------------

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        match: PrefixMatch | None = None,
        extra_blocks: int = 0,
    ) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens, reusing `match` first.

        Returns False (changing nothing) when the pool is too small, counting `extra_blocks` that
        the caller needs right after (fork copies); the scheduler then preempts.
        """
        if not self.can_allocate(seq, num_new_tokens, match, extra_blocks):
            return False
        if match is not None and self.enable_prefix_caching:
            self.stats.queries += seq.num_tokens
        if match and match.num_blocks():
            self._attach_match(seq, match)
        for _ in range(self.blocks_needed(seq, num_new_tokens, None)):
            seq.block_table.append(self._take_free_block())
        return True

    def _attach_match(self, seq: Sequence, match: PrefixMatch) -> None:
        for block_id in match.device_blocks:
            self._touch(block_id)
            seq.block_table.append(block_id)
        for key in match.tier_keys:
            block_id = self._take_free_block()
            seq.block_table.append(block_id)
            self._pending_loads.append((key, block_id))
        num_cached = match.num_blocks() * self.block_size
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = len(match.device_blocks)
        self.stats.hits += len(match.device_blocks) * self.block_size
        self.stats.tier_hits += len(match.tier_keys) * self.block_size

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.pop()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            self._evict(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _evict(self, block: Block) -> None:
        assert block.key is not None
        if self.tier is not None:
            self.tier.on_evict(block.key, block.block_id)
        del self._index[block.key]
        self._events.append(BlockRemoved(block.key, block.block_id))
        self.stats.evictions += 1
        block.key = None
        block.token_ids = ()

    def take_pending_loads(self) -> list[tuple[bytes, int]]:
        """(key, block_id) pairs a lower tier must write into the device cache before the forward."""
        loads, self._pending_loads = self._pending_loads, []
        return loads

    # ---- after compute --------------------------------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full <= seq.num_registered_blocks:
            return
        self.update_hashes(seq)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            key = seq.block_hashes[i]
            if block.key is None and key not in self._index:
                block.key = key
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._index[key] = block.block_id
                parent = seq.block_hashes[i - 1] if i else self._event_root(seq)
                self._events.append(BlockStored(key, parent, block.token_ids, block.block_id))
                if self.tier is not None:
                    self.tier.on_store(key, block.block_id)
        seq.num_registered_blocks = num_full

    def _event_root(self, seq: Sequence) -> bytes | None:
        """The parent named in a first block's event: None for the shared namespace; a salted
        block names its salted root, so a router's prefix tree never takes it for the same
        tokens unsalted."""
        return self._root_of(seq) if seq.request.params.cache_salt else None

    # ---- release and sharing --------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (tail first) and reset its progress."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.key is None:
            self._free_uncached.append(block_id)
        else:
            self._free_cached[block_id] = None

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (speculative slots of rejected
        drafts). Those blocks were never registered: they hold no verified full block."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share the parent's full blocks with `child`; copy its partial last block.

        The parent's block table must already cover its whole prompt. Returns (src, dst) block ids
        to copy on the device after this step's forward, or None when the last block is full.
        Raises RuntimeError when no block is free for the copy (the caller checks capacity first).
        """
        num_full = parent.num_tokens // self.block_size
        for block_id in parent.block_table[:num_full]:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table[:num_full])
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        if len(parent.block_table) == num_full:
            return None
        if not self.num_free_blocks:
            raise RuntimeError("no free block for the forked sequence's partial block")
        dst = self._take_free_block()
        child.block_table.append(dst)
        return parent.block_table[num_full], dst

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (e.g. after weights change)."""
        while self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            self._evict(self.blocks[block_id])
            self._free_uncached.append(block_id)
