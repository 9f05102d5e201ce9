"""`ServerConfig`: the frontend's own settings (address, auth, limits, names), frozen, built by the CLI.

Engine settings live in engine/config.py; this holds only what the HTTP layer needs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # Each key's requests share prefix-cache blocks only with the same key's. None: on when more
    # than one key is configured (see `salts_by_api_key`).
    cache_salt_by_api_key: bool | None = None
    max_body_bytes: int = 8 * 2**20  # larger bodies get 413 before they are parsed
    role: str = "mixed"  # metrics label: "mixed" | "frontend" | "prefill" | "decode"
    stream_keepalive_s: float = 15.0
    # Stored Responses (previous_response_id) also go to this Redis when set (--kv-store).
    response_store_url: str | None = None

    @property
    def salts_by_api_key(self) -> bool:
        """Whether the prefix cache is salted by API key. By default it is whenever there are
        several keys: each key is then a tenant, and one tenant must not learn from
        `cached_tokens` or the time to first token what another sent. One key (a team sharing
        it) keeps one cache; a team holding several keys turns salting off explicitly."""
        if self.cache_salt_by_api_key is None:
            return len(self.api_keys) > 1
        return self.cache_salt_by_api_key
