"""The deployment files hold together: compose structure, the Dockerfile's inputs, Prometheus
targets, Grafana provisioning and dashboard. Docker cannot run here; these are the static checks
`docker compose config` and a build would otherwise catch, plus the ones they would not."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import runpy
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_compose import (
    COMPOSE_FILE,
    DASHBOARD_FILE,
    DATASOURCE_FILE,
    DOCKER_DIR,
    PROMETHEUS_FILE,
    REPO,
    SECRETS_MOUNT,
    STORE_VOLUME,
    as_env_dict,
    compose_variables,
    container_port,
    interpolate,
    is_deepserve,
    load_compose,
    local_paths,
    localize,
    make_secrets,
    named_mounts,
    read_secret,
    volume_folder,
)

from deepserve.server.cli import build_parser

DOCKERFILE = DOCKER_DIR / "Dockerfile"
ROLES_CMDS = ("serve", "frontend", "worker")  # the subcommands that listen
WORKERS = ("prefill", "decode-1", "decode-2")
PUBLISHED = {"frontend", "prometheus", "grafana"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def _services(compose: dict) -> dict[str, dict]:
    return compose["services"]


def _bind_sources(service: dict) -> list[str]:
    out = []
    for volume in service.get("volumes", []):
        source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source", "")
        if source.startswith((".", "/")):
            out.append(source)
    return out


def test_root_compose_includes_the_docker_compose_file():
    root = yaml.safe_load((REPO / "compose.yaml").read_text())
    included = [entry if isinstance(entry, str) else entry["path"] for entry in root["include"]]
    assert [(REPO / p).resolve() for p in included] == [COMPOSE_FILE.resolve()]


def test_compose_has_the_disaggregated_topology(compose):
    services = _services(compose)
    assert {"redis", "frontend", *WORKERS, "prometheus", "grafana"} <= set(services)
    roles = {n: services[n]["command"][services[n]["command"].index("--role") + 1] for n in WORKERS}
    assert roles == {"prefill": "prefill", "decode-1": "decode", "decode-2": "decode"}
    frontend = services["frontend"]["command"]
    assert frontend[0] == "frontend"
    for worker in WORKERS:
        assert any(f"//{worker}:{container_port(worker, services[worker])}" in a for a in frontend)


def test_every_service_has_an_image_or_a_build(compose):
    for name, service in _services(compose).items():
        assert service.get("image") or service.get("build"), name


def test_build_context_and_dockerfile_exist(compose):
    for name, service in _services(compose).items():
        build = service.get("build")
        if build is None:
            continue
        context = (DOCKER_DIR / build["context"]).resolve()
        assert context == REPO, name
        assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name


def test_every_bind_mounted_file_exists(compose):
    for name, service in _services(compose).items():
        for source in _bind_sources(service):
            assert (DOCKER_DIR / source).exists(), f"{name}: {source}"


def test_named_volumes_are_declared(compose):
    declared = set(compose.get("volumes") or {})
    for name, service in _services(compose).items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: {source}"


def test_only_frontend_and_the_uis_are_published(compose):
    published = {n for n, s in _services(compose).items() if s.get("ports")}
    assert published == PUBLISHED
    assert _services(compose)["frontend"]["ports"] == ["8000:8000"]


def test_depends_on_names_existing_services(compose):
    services = _services(compose)
    for name, service in services.items():
        for dep in service.get("depends_on") or []:
            assert dep in services, f"{name} -> {dep}"


def test_every_variable_has_a_default():
    """`docker compose up` works with an empty environment: load_compose({}) raises otherwise,
    and a bare ${VAR} would silently become empty."""
    text = COMPOSE_FILE.read_text()
    for name in compose_variables():
        uses = re.findall(rf"\$\{{{name}(:?-)?[^}}]*\}}", text)
        assert uses and all(op for op in uses), f"${{{name}}} has no default"


def test_no_secret_is_on_a_command_line_or_in_an_environment(compose):
    """Secrets are files in the `secrets` volume: what compose passes is only their paths."""
    services = _services(compose)
    for name, service in services.items():
        command = " ".join(str(a) for a in service.get("command") or [])
        assert "@" not in command and "requirepass" not in command, name
        for key, value in as_env_dict(service.get("environment")).items():
            if re.search(r"TOKEN|PASSWORD|SECRET|KEY", key):
                assert key.endswith("_FILE"), f"{name}: {key}"
                assert value.startswith(SECRETS_MOUNT + "/"), f"{name}: {key}"
    assert services["redis"]["command"][1] == f"{SECRETS_MOUNT}/redis.conf"


def _dependencies(services: dict[str, dict], name: str) -> set[str]:
    """Every service `name` waits for, directly or through others."""
    out: set[str] = set()
    todo = list(services[name].get("depends_on") or [])
    while todo:
        dep = todo.pop()
        if dep not in out:
            out.add(dep)
            todo += list(services[dep].get("depends_on") or [])
    return out


def _secrets_read(service: dict) -> set[str]:
    """The secret files a service's command, environment and healthcheck name."""
    return set(re.findall(rf"{SECRETS_MOUNT}/([\w.]+)", json.dumps(service)))


def _readers(compose: dict) -> dict[str, dict]:
    """The services that read secrets (the `secrets` service writes them)."""
    return {n: s for n, s in _services(compose).items() if _secrets_read(s) and n != "secrets"}


def test_every_service_reading_secrets_mounts_its_own_volume_read_only(compose):
    services = _services(compose)
    for name, service in _readers(compose).items():
        volume = named_mounts(service)[SECRETS_MOUNT]
        assert f"{volume}:{SECRETS_MOUNT}:ro" in service["volumes"], name
        assert volume in named_mounts(services["secrets"]).values(), f"{name}: {volume}"
        assert "secrets" in _dependencies(services, name), f"{name} may start before its secrets"
    assert services["redis"]["depends_on"]["secrets"]["condition"] == (
        "service_completed_successfully"
    )


def test_the_store_of_every_secret_is_mounted_by_the_secrets_service_alone(compose):
    for name, service in _services(compose).items():
        if STORE_VOLUME in named_mounts(service).values():
            assert name == "secrets", name
    assert named_mounts(_services(compose)["secrets"])[SECRETS_MOUNT] == STORE_VOLUME


def test_each_service_holds_exactly_the_secrets_it_reads(compose, tmp_path):
    make_secrets(compose, tmp_path)
    for name, service in _readers(compose).items():
        folder = local_paths(service, tmp_path)[SECRETS_MOUNT]
        assert {p.name for p in folder.iterdir()} == _secrets_read(service), name


def test_redis_and_grafana_cannot_read_the_api_key_token_or_kv_secret(compose, tmp_path):
    make_secrets(compose, tmp_path)
    services = _services(compose)
    for name in ("redis", "grafana"):
        folder = local_paths(services[name], tmp_path)[SECRETS_MOUNT]
        held = {p.name for p in folder.iterdir()}
        assert held and not held & {"api_key", "internal_token", "kv_secret"}, name


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_secret_but_grafanas_is_readable_by_its_owner_only(compose, tmp_path):
    """The `secrets` service runs as the image's deepserve user, so 0400 is that user's alone.
    Grafana runs as its image's user: its copy holds its admin password alone (test above)."""
    make_secrets(compose, tmp_path)
    services = _services(compose)
    readers = [n for n in _readers(compose) if n != "grafana"]
    folders = [volume_folder(tmp_path, STORE_VOLUME)]
    folders += [local_paths(services[n], tmp_path)[SECRETS_MOUNT] for n in readers]
    assert {"frontend", "prefill", "redis"} <= set(readers)
    for folder in folders:
        assert _mode(folder) == 0o700, folder.name
        for path in folder.iterdir():
            assert _mode(path) == 0o400, f"{folder.name}/{path.name}"


def test_the_secrets_service_user_is_the_deepserve_image_user(compose):
    """What makes 0400 mean "the deepserve user only": the generator runs as that user."""
    service = _services(compose)["secrets"]
    assert "user" not in service  # the image's USER
    users = [rest for kw, rest in _dockerfile_instructions() if kw == "USER"]
    assert users[-1] == "deepserve"


def _image_uid() -> str:
    useradd = next(r for kw, r in _dockerfile_instructions() if kw == "RUN" and "useradd" in r)
    return useradd.split("--uid", 1)[1].split()[0]


def test_redis_runs_as_the_deepserve_image_uid(compose):
    """Its owner-only secrets are written by that uid: another could not read them."""
    assert _services(compose)["redis"]["user"] == f"{_image_uid()}:{_image_uid()}"


def test_a_secret_the_operator_wrote_is_kept_and_made_owner_only(compose, tmp_path):
    store = volume_folder(tmp_path, STORE_VOLUME)
    store.mkdir(parents=True)
    (store / "api_key").write_text("chosen-by-the-operator\n")
    (store / "api_key").chmod(0o644)
    make_secrets(compose, tmp_path)
    frontend = local_paths(_services(compose)["frontend"], tmp_path)[SECRETS_MOUNT]
    assert read_secret(frontend, "api_key") == "chosen-by-the-operator"
    assert _mode(store / "api_key") == 0o400


def test_the_secrets_service_generates_every_file_the_services_read(compose, tmp_path):
    make_secrets(compose, tmp_path)
    services = _services(compose)
    for name, service in _readers(compose).items():
        folder = local_paths(service, tmp_path)[SECRETS_MOUNT]
        assert all((folder / f).is_file() for f in _secrets_read(service)), name
    assert set(_readers(compose)) == {"redis", "grafana", "frontend", *WORKERS}
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"].startswith(
        SECRETS_MOUNT
    )


def test_the_secrets_folders_exist_in_the_image_owned_by_its_user(compose):
    """A named volume starts as a copy of the image's folder at its mount point: one the image
    lacks would start root-owned, and the `secrets` service could not write its copy there."""
    created = (
        next(
            rest for kw, rest in _dockerfile_instructions() if kw == "RUN" and "install -d" in rest
        )
        .split("install -d -o deepserve -g deepserve -m 0700")[1]
        .split()
    )
    assert set(named_mounts(_services(compose)["secrets"])) <= set(created)


def test_the_project_is_named_deepserve_from_either_file():
    assert yaml.safe_load((REPO / "compose.yaml").read_text())["name"] == "deepserve"
    assert yaml.safe_load(COMPOSE_FILE.read_text())["name"] == "deepserve"


def test_the_image_is_built_once_and_never_pulled(compose):
    services = _services(compose)
    built = [name for name, service in services.items() if "build" in service]
    assert built == ["secrets"] and services["secrets"]["pull_policy"] == "build"
    image = services["secrets"]["image"]
    for name, service in services.items():
        if service.get("image") == image and name != "secrets":
            assert service["pull_policy"] == "never", name
            assert "secrets" in _dependencies(services, name), f"{name} may start before the build"


def test_deepserve_commands_build_their_configs_with_the_real_cli(compose, monkeypatch, tmp_path):
    """Each command parses, and its config builds under the service's compose environment (the
    CLI reads the internal token and the Redis password from the files it names there)."""
    from deepserve.server import cli

    folder = make_secrets(compose, tmp_path)
    for name, service in _services(compose).items():
        if not is_deepserve(service):
            continue
        with monkeypatch.context() as m:
            for key, value in as_env_dict(service.get("environment")).items():
                m.setenv(key, localize(value, local_paths(service, tmp_path)))
            args = cli.build_parser().parse_args([str(a) for a in service["command"]])
            assert args.internal_token == read_secret(folder, "internal_token"), name
            password = read_secret(folder, "redis_password")
            if args.command == "worker":
                assert cli.worker_config_from_args(args).role == args.role
                store = cli.engine_config_from_args(args).kv_tiers.store_url
                assert f":{password}@redis:" in store, name
            else:
                assert args.command == "frontend", name
                config = cli.frontend_config_from_args(args)
                assert config.server.api_keys == (read_secret(folder, "api_key"),)
                assert set(config.router.workers["decode"]) == {
                    "http://decode-1:8100",
                    "http://decode-2:8100",
                }
                assert f":{password}@redis:" in config.router.kv_events_url


def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$HOME", env) == "x d  d $HOME"


# ---- Dockerfile -----------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip().rstrip("/") for ln in lines if ln.strip() and not ln.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(p, pat) for p in prefixes for pat in patterns)


def _copy_sources() -> list[str]:
    sources = []
    for keyword, rest in _dockerfile_instructions():
        if keyword == "COPY" and "--from=" not in rest:
            sources += rest.split()[:-1]
    return sources


def test_dockerfile_copies_existing_unignored_files():
    patterns = _dockerignore_patterns()
    sources = _copy_sources()
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert not _ignored(source, patterns), f"{source} is excluded by .dockerignore"


def test_the_hosts_prebuilt_native_kernels_stay_out_of_the_build_context():
    """`make setup` installs libraries built for this host there; the image compiles its own, and
    a host's library in the context would ship in the image and change its kernels layer."""
    from deepserve.kernels.cpu import native

    prebuilt = native.PREBUILT.relative_to(Path(native.__file__).parents[2])
    assert _ignored(f"{prebuilt}/deepserve_cpu-0.so", _dockerignore_patterns())


def _package_roots() -> tuple[str, ...]:
    """setup.py's ROOTS: the top-level folders that become deepserve.* packages."""
    tree = ast.parse((REPO / "setup.py").read_text())
    return next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ROOTS"
    )


def test_dockerfile_copies_every_package_root():
    roots = _package_roots()
    copied = {Path(s).parts[0] for s in _copy_sources()}
    assert set(roots) <= copied
    assert {"pyproject.toml", "setup.py", "README.md"} <= copied


def test_dockerfile_runs_as_non_root_and_bakes_the_model():
    instructions = _dockerfile_instructions()
    stages = {rest.split(" AS ")[-1].strip() for kw, rest in instructions if kw == "FROM"}
    assert stages == {"base", "build", "runtime"}
    users = [rest for kw, rest in instructions if kw == "USER"]
    assert users and users[-1] not in {"root", "0"}
    assert any(kw == "HEALTHCHECK" for kw, _ in instructions)
    assert any(kw == "RUN" and "deepserve fetch-model" in rest for kw, rest in instructions)
    assert any(
        kw == "RUN" and "kernels/cpu/native.py --prebuild" in rest for kw, rest in instructions
    )
    assert ("ENTRYPOINT", '["deepserve"]') in instructions


def test_dockerfile_cpu_build_names_no_cuda_image_and_fetches_no_frontend():
    """The legacy builder builds every stage: a CPU build must not need the CUDA base image, and a
    `# syntax=` line would make BuildKit fetch a frontend image from a registry."""
    assert not DOCKERFILE.read_text().lstrip().lower().startswith("# syntax")
    instructions = _dockerfile_instructions()
    froms = [rest for kw, rest in instructions if kw == "FROM"]
    assert froms[0] == "${BASE_IMAGE} AS base"
    assert all(not f.startswith("nvidia/") for f in froms)
    assert ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm") in instructions
    assert ("ARG", "TORCH_INDEX=cpu") in instructions


def test_the_image_exposes_no_port():
    """An image-level EXPOSE shows on every container of the image (`docker compose ps`), and the
    roles listen on different ports: a worker would list the frontend's 8000."""
    assert [rest for kw, rest in _dockerfile_instructions() if kw == "EXPOSE"] == []


def test_every_listening_service_declares_exactly_its_own_port(compose):
    for name, service in _services(compose).items():
        if not (is_deepserve(service) or name == "redis"):
            continue
        published = {str(p).rsplit(":", 1)[-1] for p in service.get("ports", [])}
        declared = {int(p) for p in {*map(str, service.get("expose", [])), *published}}
        assert declared == {container_port(name, service)}, name


def test_dockerfile_default_command_parses_with_the_real_cli():
    cmd = next(rest for kw, rest in _dockerfile_instructions() if kw == "CMD")
    args = build_parser().parse_args(json.loads(cmd))
    assert args.command == "serve"


# ---- Prometheus -----------------------------------------------------------------------------


def _scrape_targets() -> list[str]:
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    return [
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    ]


def test_prometheus_scrapes_every_deepserve_service(compose):
    services = _services(compose)
    expected = {f"{n}:{container_port(n, s)}" for n, s in services.items() if is_deepserve(s)}
    assert expected <= set(_scrape_targets())


def test_prometheus_targets_are_compose_services(compose):
    services = _services(compose)
    for target in _scrape_targets():
        host, port = target.rsplit(":", 1)
        if host == "localhost":
            continue
        assert host in services, target
        assert int(port) == container_port(host, services[host]), target


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_prometheus_config_passes_promtool():
    result = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(PROMETHEUS_FILE)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _container_mounts(compose: dict, service: str) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    out = {}
    for volume in _services(compose)[service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (DOCKER_DIR / source).resolve()
    return out


def test_prometheus_rule_files_are_mounted(compose):
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    mounts = _container_mounts(compose, "prometheus")
    assert config["rule_files"]
    for rule_file in config["rule_files"]:
        assert rule_file in mounts, rule_file
        assert mounts[rule_file].is_file(), rule_file


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_alert_rules_pass_promtool():
    result = subprocess.run(
        ["promtool", "check", "rules", str(DOCKER_DIR / "alerts.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---- Grafana --------------------------------------------------------------------------------


def _datasource_uid() -> str:
    (source,) = yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"]
    assert source["type"] == "prometheus"
    return source["uid"]


def _dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def test_datasource_points_at_the_compose_prometheus(compose):
    (source,) = yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"
    assert "prometheus" in _services(compose)


def test_dashboard_provisioning_path_is_the_mounted_folder(compose):
    provider_file = DOCKER_DIR / "grafana" / "provisioning" / "dashboards" / "deepserve.yml"
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in _services(compose)["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_dashboard_panels_use_the_provisioned_datasource():
    uid = _datasource_uid()
    panels = [p for p in _panels(_dashboard()) if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_dashboard_ids_and_grid_are_consistent():
    dashboard = _dashboard()
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"]
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["refId"], panel["title"]


def test_dashboard_json_is_the_builder_output():
    builder = runpy.run_path(str(DOCKER_DIR / "grafana" / "build_dashboard.py"))
    assert DASHBOARD_FILE.read_text() == builder["render"](), (
        "run docker/grafana/build_dashboard.py"
    )


def test_non_editable_install_ships_every_module_and_the_cli(tmp_path):
    """The image installs the package with `pip install .` (not editable, as tests here run):
    every module under the package roots must land in the wheel, and the `deepserve` script."""
    import zipfile

    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("deepserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p for root in _package_roots() for p in (REPO / root).rglob("*.py")]
    missing = [
        str(p.relative_to(REPO)) for p in sources if f"deepserve/{p.relative_to(REPO)}" not in names
    ]
    assert not missing, f"not in the wheel (a folder without __init__.py?): {missing}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "deepserve = deepserve.server.cli:main" in text


def test_generated_secrets_are_random_and_kept_across_restarts(compose, tmp_path):
    folder = make_secrets(compose, tmp_path / "a")
    first = {name: read_secret(folder, name) for name in ("api_key", "internal_token")}
    make_secrets(compose, tmp_path / "a")  # a restart
    other = make_secrets(compose, tmp_path / "b")
    for name in ("api_key", "internal_token", "redis_password", "kv_secret"):
        assert len(read_secret(folder, name)) >= 43
        assert read_secret(folder, name) != read_secret(other, name), name
    assert {name: read_secret(folder, name) for name in first} == first
    password = read_secret(folder, "redis_password")
    assert (folder / "redis.conf").read_text() == f"requirepass {password}\n"


def test_a_secret_dropped_from_a_services_list_leaves_its_volume(compose, tmp_path):
    make_secrets(compose, tmp_path)
    redis = local_paths(_services(compose)["redis"], tmp_path)[SECRETS_MOUNT]
    (redis / "api_key").write_text("left over from an older stack")
    make_secrets(compose, tmp_path)
    assert not (redis / "api_key").exists()
