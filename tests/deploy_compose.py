"""Helpers for the deployment tests: docker/docker-compose.yml read the way Docker Compose reads it,
and its services turned into local processes.

Docker cannot run on the test machines, so the tests run the compose topology natively: the same
commands, arguments and environment, with every service hostname mapped to 127.0.0.1 and every
container port to a free loopback port (containers each have their own network namespace; local
processes share one). Not a test module: the deploy tests import it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO / "docker"
COMPOSE_FILE = DOCKER_DIR / "docker-compose.yml"
PROMETHEUS_FILE = DOCKER_DIR / "prometheus.yml"
HEALTHCHECK_SCRIPT = DOCKER_DIR / "healthcheck.py"
DASHBOARD_FILE = DOCKER_DIR / "grafana" / "dashboards" / "deepserve.json"
DATASOURCE_FILE = DOCKER_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yml"

SECRETS_SCRIPT = DOCKER_DIR / "gen_secrets.py"

DEEPSERVE_IMAGE = "deepserve"
REDIS_PORT = 6379
# Where every container that reads secrets mounts its own volume of them (the `secrets` service:
# the store of them all).
SECRETS_MOUNT = "/run/deepserve-secrets"
STORE_VOLUME = "secrets"

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, $VAR and the $$ escape.
_VAR = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


class InterpolationError(ValueError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    """Expand compose variables in one string the way `docker compose` does."""

    def expand(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        value = env.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op is None:
            return value or ""
        if op.endswith("-"):
            return arg if unset else value
        if unset:
            raise InterpolationError(f"${{{name}}}: {arg or 'required'}")
        return value

    return _VAR.sub(expand, text)


def interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    return node


def compose_variables(path: Path = COMPOSE_FILE) -> set[str]:
    """Names of every variable the compose file refers to."""
    text = path.read_text()
    return {m.group("name") or m.group("bare") for m in _VAR.finditer(text) if m.group(0) != "$$"}


def load_compose(path: Path = COMPOSE_FILE, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file with anchors merged and variables expanded (defaults when env is empty)."""
    raw = yaml.safe_load(path.read_text())
    return interpolate_tree(raw, {} if env is None else env)


def as_env_dict(environment: Any) -> dict[str, str]:
    """A service's `environment:` in either compose form (mapping or KEY=VALUE list)."""
    if environment is None:
        return {}
    if isinstance(environment, dict):
        return {k: "" if v is None else str(v) for k, v in environment.items()}
    return dict(item.split("=", 1) for item in environment)


def is_deepserve(service: dict[str, Any]) -> bool:
    """A service that runs a `deepserve` process (the image's entrypoint; the `secrets` service
    runs another program of the same image)."""
    image = "build" in service or str(service.get("image", "")).startswith(DEEPSERVE_IMAGE + ":")
    return image and "entrypoint" not in service


def named_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> named volume, for each named volume a service mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith((".", "/")):
            out[target] = source
    return out


def volume_folder(data_dir: Path, volume: str) -> Path:
    """The local folder standing for a named volume."""
    return data_dir / "volumes" / volume


def local_paths(service: dict[str, Any], data_dir: Path) -> dict[str, Path]:
    """Container path -> local folder, for the named volumes a service mounts."""
    return {target: volume_folder(data_dir, v) for target, v in named_mounts(service).items()}


def localize(text: str, paths: dict[str, Path]) -> str:
    """`text` with each mount point of `paths` (a whole path component) made local."""
    for target in sorted(paths, key=len, reverse=True):
        text = re.sub(rf"{re.escape(target)}(?![\w.-])", str(paths[target]), text)
    return text


def make_secrets(compose: dict[str, Any], data_dir: Path) -> Path:
    """What the `secrets` service does on first start, with its volumes as local folders under
    `data_dir` (volume_folder); returns the store's folder."""
    service = compose["services"]["secrets"]
    assert service["entrypoint"] == ["deepserve-secrets"]
    paths = local_paths(service, data_dir)
    for folder in paths.values():
        folder.mkdir(parents=True, exist_ok=True)
    argv = [localize(str(a), paths) for a in service["command"]]
    subprocess.run([sys.executable, str(SECRETS_SCRIPT), *argv], check=True, capture_output=True)
    return volume_folder(data_dir, STORE_VOLUME)


def read_secret(folder: Path, name: str) -> str:
    return (folder / name).read_text().strip()


def container_port(name: str, service: dict[str, Any]) -> int:
    """The port the service listens on inside its container."""
    command = [str(a) for a in service.get("command", [])]
    if "--port" in command:
        return int(command[command.index("--port") + 1])
    if name == "redis":
        return REDIS_PORT
    raise ValueError(f"service {name!r}: cannot tell its port")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    depends_on: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LoopbackMap:
    """Rewrites `service:port` addresses in compose values to `127.0.0.1:<free port>`, and each
    service's volume mount points to local folders."""

    def __init__(
        self, ports: dict[str, tuple[int, int]], mounts: dict[str, dict[str, Path]]
    ) -> None:
        self.ports = ports  # service -> (container port, local port)
        self.mounts = mounts  # service -> container path -> the local folder standing for it
        names = "|".join(re.escape(n) for n in sorted(ports, key=len, reverse=True))
        self._remote = re.compile(rf"(?<![\w.-])({names}):(\d+)(?![\w.-])")

    def local_port(self, service: str) -> int:
        return self.ports[service][1]

    def rewrite(self, text: str, own: str | None = None) -> str:
        def sub(m: re.Match[str]) -> str:
            return f"127.0.0.1:{self.local_port(m.group(1))}"

        text = self._remote.sub(sub, text)
        if own is not None:
            text = localize(text, self.mounts.get(own, {}))
            inner, local = self.ports[own]
            text = re.sub(rf"(127\.0\.0\.1|localhost):{inner}\b", f"127.0.0.1:{local}", text)
        return text

    def rewrite_argv(self, service: str, argv: list[str]) -> list[str]:
        out = []
        for i, arg in enumerate(argv):
            prev = argv[i - 1] if i else ""
            if prev == "--host" and arg == "0.0.0.0":
                arg = "127.0.0.1"
            elif prev == "--port":
                arg = str(self.local_port(service))
            out.append(self.rewrite(arg, own=service))
        return out


def local_topology(compose: dict[str, Any], bin_dir: Path, data_dir: Path) -> list[LocalService]:
    """Redis and the deepserve services of the compose file as local processes, in start order;
    their secrets generated as the `secrets` service would, volumes as folders under `data_dir`."""
    services = compose["services"]
    wanted = [n for n, s in services.items() if n == "redis" or is_deepserve(s)]
    ports = {n: (container_port(n, services[n]), free_port()) for n in wanted}
    make_secrets(compose, data_dir)
    loopback = LoopbackMap(ports, {n: local_paths(services[n], data_dir) for n in wanted})
    out = []
    for name in _start_order(services, wanted):
        svc = services[name]
        argv = loopback.rewrite_argv(name, [str(a) for a in svc.get("command", [])])
        if is_deepserve(svc):
            argv = [str(bin_dir / "deepserve"), *argv]
        else:
            assert argv[0] == "redis-server", "only the redis image is run from a system binary"
            argv = [shutil.which("redis-server") or "redis-server", *argv[1:]]
            argv += ["--port", str(loopback.local_port(name)), "--bind", "127.0.0.1"]
            argv += ["--dir", str(data_dir)]
        env = {
            k: loopback.rewrite(v, own=name) for k, v in as_env_dict(svc.get("environment")).items()
        }
        deps = [d for d in _depends_on(svc) if d in wanted]
        out.append(LocalService(name, argv, env, loopback.local_port(name), deps))
    return out


def _depends_on(service: dict[str, Any]) -> list[str]:
    deps = service.get("depends_on") or []
    return list(deps) if isinstance(deps, list | dict) else []


def _start_order(services: dict[str, Any], names: list[str]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle through {name}"
        if name in order:
            return
        for dep in _depends_on(services[name]):
            if dep in names:
                visit(dep, (*path, name))
        order.append(name)

    for name in names:
        visit(name, ())
    return order


def run_healthcheck(service: LocalService, timeout_s: float = 5.0) -> bool:
    """The image's HEALTHCHECK (docker/healthcheck.py) with the service's environment."""
    env = {**os.environ, **service.env}
    try:
        result = subprocess.run(
            [sys.executable, str(HEALTHCHECK_SCRIPT)],
            env=env,
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:  # as Docker counts a probe past its timeout: unhealthy
        return False
    return result.returncode == 0


def redis_ping(port: int, password: str | None) -> bool:
    import redis

    try:
        return bool(redis.Redis(port=port, password=password, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until(check, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        if check():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s")
