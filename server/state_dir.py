"""The server's state directory on one machine, and the one thing kept there: the local KV secret.

`deepserve serve` (or a worker) with an L2 store but no configured KV secret signs its blocks with
a secret generated once and kept in this directory, so every process of the same user on the
machine, and the same process after a restart, can read the blocks the others wrote. The
directory is created 0700 and the secret file 0600; one that others could read is refused rather
than used. Multi-host deployments give every worker the same secret instead
($DEEPSERVE_KV_SECRET or --kv-secret-file); the directory's location comes from the CLI
(server/cli.py), which is the only place that reads the environment.

Not here: how the secret becomes a MAC key (kvcache/codec.py derive_mac_key).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path

KV_SECRET_FILE = "kv-secret"


class StateDirError(RuntimeError):
    """The state directory or its secret is unusable (not ours, or readable by others)."""


def default_state_dir(environ: dict[str, str]) -> Path:
    """`$XDG_STATE_HOME/deepserve`, else `~/.local/state/deepserve` (the XDG base-dir default)."""
    base = environ.get("XDG_STATE_HOME") or os.path.join(
        environ.get("HOME") or os.path.expanduser("~"), ".local", "state"
    )
    return Path(base) / "deepserve"


def local_kv_secret(state_dir: Path) -> bytes:
    """The machine-local KV secret in `state_dir`, generated on first use.

    Two processes starting together agree: the secret is written to a private temporary file and
    published with a hard link, which fails if another process published first, so a reader
    never sees a half-written file and every process reads the same one.
    """
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(state_dir, 0o077)
    path = state_dir / KV_SECRET_FILE
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".kv-secret-")  # created 0600
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.fsync(fd)
            os.close(fd)
            # FileExistsError: another process published its secret first; use that one.
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    _check_private(path, 0o077)
    secret = path.read_bytes().strip()
    if not secret:
        raise StateDirError(f"{path} is empty; delete it to generate a new KV secret")
    return secret


def _check_private(path: Path, forbidden: int) -> None:
    st = path.stat()
    if st.st_uid != os.getuid():
        raise StateDirError(f"{path} belongs to another user; pass --state-dir to use your own")
    if st.st_mode & forbidden:
        mode = stat.filemode(st.st_mode)
        raise StateDirError(
            f"{path} is readable or writable by other users ({mode}); it holds the KV secret, "
            f"so it must be owner-only (chmod go-rwx {path})"
        )
