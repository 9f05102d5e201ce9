#!/usr/bin/env python3
"""Generates the compose stack's secrets on first start, and hands each service only its own:
`deepserve-secrets STORE [--copy DIR:MODE:NAME[,NAME...]]...`.

STORE (the `secrets` volume, mounted by this service alone) keeps every secret: each missing one
is written as a file of 43 random URL-safe characters (256 bits), and `redis.conf` (the
`requirepass` line) for redis-server, whose password thus never appears on a command line or in an
environment. A secret that already exists is kept, so a restart keeps its keys; `docker compose
down -v` deletes the volumes, and the next start generates new ones. To choose one yourself, write
its file into STORE before the first start (the README's Docker section shows how).

Each `--copy` writes the named files into DIR (a volume that only the service reading them
mounts) with MODE, and deletes any other file there, so a service never holds another's secret.
This runs as the deepserve user, so 0400 copies are readable by that uid alone: the deepserve
processes, and redis, which compose runs as the same uid (it keeps no data). Grafana keeps its
database in a volume its image's user owns (an existing one would not open under another uid),
so its copy, nothing but its admin password, is 0444 in a volume only grafana mounts.

Nothing is printed but the names and the command that shows the API key: container logs are kept.
Standard library only.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

SECRETS = ("api_key", "internal_token", "redis_password", "kv_secret", "grafana_admin_password")
DERIVED = ("redis.conf",)  # written from the secrets above on every start
OWNER_ONLY = 0o400


@dataclass(frozen=True)
class Copy:
    """One service's share: the files it reads, in a folder only it mounts."""

    folder: Path
    mode: int
    names: tuple[str, ...]


def parse_copy(text: str) -> Copy:
    folder, mode, names = text.rsplit(":", 2)
    unknown = set(names.split(",")) - set(SECRETS) - set(DERIVED)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown secrets: {', '.join(sorted(unknown))}")
    return Copy(Path(folder), int(mode, 8), tuple(names.split(",")))


def write_file(path: Path, text: str, mode: int) -> None:
    """Atomically, with `mode` from the start (never readable by others, not even for a moment)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)  # os.open's mode passes through the umask
    os.replace(tmp, path)


def ensure(store: Path) -> list[str]:
    """Generate the missing secrets into `store`, owner-only; returns the names generated now."""
    store.chmod(0o700)
    created = []
    for name in SECRETS:
        path = store / name
        if path.is_file() and path.read_text().strip():
            # A file the operator wrote is kept, made owner-only like the generated ones.
            path.chmod(OWNER_ONLY)
            continue
        # A trailing newline, so `cat` of a key ends its line; readers drop it
        # (server/cli.py env_secret, Grafana's __FILE, redis.conf below strips it).
        write_file(path, secrets.token_urlsafe(32) + "\n", OWNER_ONLY)
        created.append(name)
    password = (store / "redis_password").read_text().strip()
    write_file(store / "redis.conf", f"requirepass {password}\n", OWNER_ONLY)
    return created


def hand_out(store: Path, copy: Copy) -> None:
    """`copy.folder` holds exactly `copy.names`, as in the store, with `copy.mode`."""
    # Readers other than the owner need to enter the folder to reach a 0444 file.
    copy.folder.chmod(0o700 if copy.mode & 0o077 == 0 else 0o755)
    for name in copy.names:
        write_file(copy.folder / name, (store / name).read_text(), copy.mode)
    for path in copy.folder.iterdir():
        if path.name not in copy.names:
            path.unlink()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepserve-secrets", description=__doc__.split("\n\n")[0])
    p.add_argument("store", type=Path, help="folder keeping every secret")
    p.add_argument(
        "--copy",
        type=parse_copy,
        action="append",
        default=[],
        metavar="DIR:MODE:NAMES",
        help="write the comma-separated NAMES into DIR with MODE (octal), and nothing else",
    )
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.store.mkdir(parents=True, exist_ok=True)
    created = ensure(args.store)
    for copy in args.copy:
        copy.folder.mkdir(parents=True, exist_ok=True)
        hand_out(args.store, copy)
    print(f"secrets in {args.store}: generated {', '.join(created) or 'none'}, kept the others")
    for copy in args.copy:
        print(f"  {copy.folder}: {', '.join(copy.names)} ({copy.mode:04o})")
    print("API key: docker compose exec frontend cat /run/deepserve-secrets/api_key")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
