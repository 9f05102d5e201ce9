"""The prefix-cache namespace of a request, as vLLM's `cache_salt`.

A salt goes into the hash of a request's first KV block (engine/block_manager.py), so blocks
computed under different salts never match: a client cannot learn from `cached_tokens` or the
time to first token whether another tenant sent a prompt. The salt is the client's `cache_salt`,
and when salting by API key (by default with more than one key: ServerConfig.salts_by_api_key)
also a digest of the API key the request came with, so a client cannot pick another key's
namespace by naming its salt.
"""

from __future__ import annotations

import hashlib


def tenant_id(api_key: str) -> str:
    """An opaque name for the holder of an API key (the key itself never leaves the middleware)."""
    return hashlib.sha256(b"deepserve tenant\0" + api_key.encode()).hexdigest()[:32]


def request_salt(client_salt: str | None, tenant: str | None) -> str | None:
    """The salt a request's blocks are hashed under; None: the shared namespace."""
    if tenant is None:
        return client_salt
    return tenant if client_salt is None else f"{tenant}:{client_salt}"
