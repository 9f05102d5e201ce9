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
    cache_salt_by_api_key: bool = False  # each key's requests share prefix-cache blocks only
    max_body_bytes: int = 8 * 2**20  # larger bodies get 413 before they are parsed
    role: str = "mixed"  # metrics label: "mixed" | "frontend" | "prefill" | "decode"
    stream_keepalive_s: float = 15.0
    # Stored Responses (previous_response_id) also go to this Redis when set (--kv-store).
    response_store_url: str | None = None
