#!/usr/bin/env python3
"""Generates the compose stack's secrets on first start: `deepserve-secrets DIR`.

Writes each missing secret as a file of 43 random URL-safe characters (256 bits) into DIR, a
named volume that the other services mount read-only, and `redis.conf` (the `requirepass` line)
for redis-server, whose password thus never appears on a command line or in an environment. A
secret that already exists is kept, so a restart keeps its keys; `docker compose down -v`
deletes the volume, and the next start generates new ones. To choose one yourself, write its
file before the first start (the README's Docker section shows how).

Nothing is printed but the names and the command that shows the API key: container logs are kept.
Standard library only.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

SECRETS = ("api_key", "internal_token", "redis_password", "kv_secret", "grafana_admin_password")


def write_file(path: Path, text: str) -> None:
    """Atomically, readable by the services' users (each runs under its own uid)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o444)
    os.replace(tmp, path)


def ensure(folder: Path) -> list[str]:
    """Generate the missing secrets; returns the names generated now."""
    created = []
    for name in SECRETS:
        path = folder / name
        if not path.is_file() or not path.read_text().strip():
            # A trailing newline, so `cat` of a key ends its line; readers drop it
            # (server/cli.py env_secret, Grafana's __FILE, redis.conf below strips it).
            write_file(path, secrets.token_urlsafe(32) + "\n")
            created.append(name)
    password = (folder / "redis_password").read_text().strip()
    write_file(folder / "redis.conf", f"requirepass {password}\n")
    return created


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: deepserve-secrets DIR", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    folder.mkdir(parents=True, exist_ok=True)
    created = ensure(folder)
    print(f"secrets in {folder}: generated {', '.join(created) or 'none'}, kept the others")
    print(f"API key: docker compose exec frontend cat {folder}/api_key")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
