"""The Kubernetes manifests (docker/k8s/): every overlay renders with `kubectl kustomize`, every
object validates, offline, against the JSON schemas of a current Kubernetes release (bundled by
kubernetes-validate, strict: no unknown fields), and the rendered pods carry what a deployment
needs: probes and resource requests on every container, GPUs on the CUDA workers, and no secret
on any container's argv or in a literal env value."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "docker" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
SECRET_ENV = {
    "DEEPSERVE_API_KEY",
    "DEEPSERVE_INTERNAL_TOKEN",
    "DEEPSERVE_REDIS_PASSWORD",
    "DEEPSERVE_KV_SECRET",
}
SECRET_FLAGS = ("--api-key", "--internal-token", "--requirepass")
PASSWORD_IN_URL = re.compile(r"rediss?(\+cluster)?://[^/@\s]*:[^/@\s]+@")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="needs kubectl (make services installs it)"
)


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def pod_specs(overlay: str) -> list[tuple[str, dict]]:
    return [
        (o["metadata"]["name"], o["spec"]["template"]["spec"])
        for o in render(overlay)
        if o["kind"] in WORKLOADS
    ]


def containers(overlay: str) -> list[tuple[str, dict]]:
    return [
        (f"{name}/{c['name']}", c)
        for name, spec in pod_specs(overlay)
        for c in spec.get("containers", []) + spec.get("initContainers", [])
    ]


def test_there_is_a_cpu_and_a_cuda_overlay():
    assert {"cpu", "cuda"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_current_kubernetes_schemas(overlay):
    version = latest_version()
    for obj in render(overlay):
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_topology_is_the_compose_stacks(overlay):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render(overlay)}
    for name in ("deepserve-frontend", "deepserve-prefill", "deepserve-decode", "deepserve-redis"):
        assert ("Deployment", name) in kinds
    services = {o["metadata"]["name"]: o["spec"] for o in render(overlay) if o["kind"] == "Service"}
    for role in ("prefill", "decode"):  # headless: one DNS record per pod, for --discover
        assert services[f"deepserve-{role}"]["clusterIP"] == "None"
    assert ("ConfigMap", "deepserve-grafana-dashboard") in kinds
    assert ("HorizontalPodAutoscaler", "deepserve-decode") in kinds
    assert any(kind == "PodDisruptionBudget" for kind, _ in kinds)


def test_the_dashboard_config_map_is_the_compose_dashboard():
    dashboard = (REPO / "docker" / "grafana" / "dashboards" / "deepserve.json").read_text()
    (cm,) = [o for o in render("cpu") if o["metadata"]["name"] == "deepserve-grafana-dashboard"]
    assert cm["data"]["deepserve.json"] == dashboard


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_liveness_and_readiness_probes(overlay):
    for name, c in containers(overlay):
        assert "livenessProbe" in c and "readinessProbe" in c, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_requests_cpu_and_memory(overlay):
    for name, c in containers(overlay):
        requests = c.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), name


def test_cuda_workers_request_a_gpu_and_cpu_workers_none():
    for overlay, want in (("cuda", "1"), ("cpu", None)):
        for name, c in containers(overlay):
            if "prefill" in name or "decode" in name:
                assert c["resources"]["requests"].get("nvidia.com/gpu") == want, (overlay, name)
                assert c["resources"].get("limits", {}).get("nvidia.com/gpu") == want


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_in_any_containers_args_or_literal_env(overlay):
    for name, c in containers(overlay):
        argv = [*c.get("command", []), *c.get("args", [])]
        for arg in argv:
            assert not any(flag in arg for flag in SECRET_FLAGS), (name, arg)
            assert not PASSWORD_IN_URL.search(arg), (name, arg)
        for env in c.get("env", []):
            if env["name"] in SECRET_ENV or env["name"] == "REDISCLI_AUTH":
                assert "value" not in env, (name, env["name"])
                assert "secretKeyRef" in env["valueFrom"], (name, env["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_maps_hold_no_secret(overlay):
    for obj in render(overlay):
        if obj["kind"] == "ConfigMap":
            assert not SECRET_ENV & set(obj.get("data", {})), obj["metadata"]["name"]
            for value in obj.get("data", {}).values():
                assert not PASSWORD_IN_URL.search(value), obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_reference_names_the_deepserve_secret(overlay):
    for name, c in containers(overlay):
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["name"] == "deepserve-secrets" and ref["key"] in SECRET_ENV, name


def test_the_frontend_discovers_both_worker_roles_by_their_headless_services():
    (args,) = [c["args"] for name, c in containers("cpu") if name.startswith("deepserve-frontend")]
    discover = args[args.index("--discover") + 1 : args.index("--discover") + 3]
    assert discover == [
        "prefill=http://deepserve-prefill:8100",
        "decode=http://deepserve-decode:8100",
    ]


def test_the_hpa_scales_decode_on_the_metric_the_adapter_serves():
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    served = {rule["name"]["as"] for rule in values["rules"]["custom"]}
    (hpa,) = [o for o in render("cpu") if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "deepserve-decode"
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion of a container argument."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def container_env(overlay: str, c: dict) -> dict[str, str]:
    """The container's non-secret environment: its ConfigMap and literal values."""
    maps = {o["metadata"]["name"]: o["data"] for o in render(overlay) if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    env.update(
        {e["name"]: "from-field" for e in c.get("env", []) if "fieldRef" in e.get("valueFrom", {})}
    )
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deepserve_containers_build_their_configs_with_the_real_cli(overlay, monkeypatch):
    """Each deepserve container's arguments, expanded as Kubernetes does, parse with the real CLI
    and build their configs (with stand-ins for the Secret's values)."""
    from deepserve.server import cli

    checked = 0
    for name, c in containers(overlay):
        if c["image"].split(":")[0].rsplit("/", 1)[-1] != "deepserve":
            continue
        checked += 1
        env = container_env(overlay, c)
        with monkeypatch.context() as m:
            for key in SECRET_ENV:
                m.setenv(key, "stand-in")
            args = cli.build_parser().parse_args([expand(a, env) for a in c["args"]])
            if args.command == "worker":
                config = cli.worker_config_from_args(args)
                assert config.kv_events_url == "redis://:stand-in@deepserve-redis:6379/0", name
                assert cli.engine_config_from_args(args).device == env["DEEPSERVE_DEVICE"]
            else:
                config = cli.frontend_config_from_args(args)
                assert config.router.discover and config.router.kv_events_url, name
    assert checked == 3  # frontend, prefill, decode


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_as_a_numeric_non_root_user(overlay):
    # The kubelet refuses runAsNonRoot for an image whose USER is a name it cannot check.
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    image_uid = int(re.search(r"useradd [^\n]*--uid (\d+)", dockerfile).group(1))
    for name, spec in pod_specs(overlay):
        context = spec.get("securityContext", {})
        assert context.get("runAsNonRoot") is True and context.get("runAsUser", 0) > 0, name
        if name != "deepserve-redis":
            assert context["runAsUser"] == image_uid, name
