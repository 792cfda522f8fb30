"""deploy/kubernetes as `kubectl kustomize` renders it: valid against Kubernetes' schemas (offline,
kubernetes-validate), each REFLOW_* it sets a real setting of the right type, each port the one its
process listens on; and the Dockerfile installs torch as `make install` does."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from reflow.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.32"  # the schemas checked against: the kubectl on the team's machines
# what the Secrets hold, as docs/kubernetes.md has operators make them
SECRETS = {
    "REFLOW_DATABASE_URL": "postgresql://reflow:PASSWORD@postgresql:5432/reflow",
    "REFLOW_REDIS_URL": "redis://redis:6379/0",
}


def rendered(path: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl, whose kustomize renders the manifests")
    text = subprocess.run(
        ["kubectl", "kustomize", str(path)], check=True, capture_output=True, text=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each workload's pod template's containers, with the workload."""
    return [
        (doc, container)
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet", "Job")
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("kustomization", [DEPLOY, DEPLOY / "overlays" / "gpu"], ids=["cpu", "gpu"])
def test_every_manifest_is_valid_kubernetes(kustomization: Path) -> None:
    docs = rendered(kustomization)
    assert {doc["kind"] for doc in docs} >= {
        "Namespace", "ConfigMap", "Service", "Job", "Deployment", "StatefulSet", "HorizontalPodAutoscaler",
        "NetworkPolicy", "PersistentVolumeClaim",
    }  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        assert doc["metadata"].get("namespace", "reflow") == "reflow"
    gpus = [
        c["resources"]["limits"].get("nvidia.com/gpu") for _, c in containers(docs) if c["args"] == ["worker"]
    ]
    assert gpus == ([1] if kustomization.name == "gpu" else [None])


def settings_of(
    container: dict[str, Any],
    configs: dict[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Settings:
    """The settings a container's process reads: its ConfigMaps' and its own REFLOW_* (a Secret's
    value as a placeholder), each file it names on a volume it mounts (and a real file, here)."""
    env = {
        k: v
        for source in container.get("envFrom", [])
        for k, v in configs[source["configMapRef"]["name"]].items()
    }
    env |= {e["name"]: e.get("value", SECRETS.get(e["name"], "")) for e in container.get("env", [])}
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    stand_in = tmp_path / "file"
    stand_in.write_text("")
    for name, value in env.items():
        if name.endswith("_FILE"):
            assert any(value.startswith(f"{mount}/") for mount in mounts), (name, value)
            env[name] = str(stand_in)
    fields = {f"REFLOW_{name.upper()}" for name in Settings.model_fields}
    assert {name for name in env if name.startswith("REFLOW_")} <= fields
    with monkeypatch.context() as patched:
        for name, value in env.items():
            patched.setenv(name, value)
        return Settings()  # over the defaults: a value of the wrong type fails here


def test_every_setting_is_real_and_every_port_the_one_its_process_listens_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = rendered(DEPLOY)
    configs = {doc["metadata"]["name"]: doc["data"] for doc in docs if doc["kind"] == "ConfigMap"}
    ports: dict[str, dict[str, int]] = {}
    for workload, container in containers(docs):
        declared = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        labels = workload["spec"]["template"].get("metadata", {}).get("labels", {})
        ports[labels.get("app.kubernetes.io/name", "")] = declared
        if container.get("command"):  # not reflow (MLflow)
            continue
        s = settings_of(container, configs, monkeypatch, tmp_path)
        listens = {
            "gateway": {"grpc": s.gateway_port, "http": s.http_port, "metrics": s.gateway_metrics_port},
            "worker": {"grpc": s.worker_port, "metrics": s.worker_metrics_port},
        }.get(container["args"][0], {})
        assert declared == listens, workload["metadata"]["name"]
        if container["args"][0] == "gateway":
            [workers] = [doc for doc in docs if doc["kind"] == "StatefulSet"]
            assert s.workers == [
                f"reflow-worker-{i}.{workers['spec']['serviceName']}:{s.worker_port}"
                for i in range(workers["spec"]["replicas"])
            ]
    for service in (doc for doc in docs if doc["kind"] == "Service" and "selector" in doc["spec"]):
        selected = ports[service["spec"]["selector"]["app.kubernetes.io/name"]]
        for port in service["spec"]["ports"]:
            assert selected[port["targetPort"]] == port["port"], service["metadata"]["name"]


def test_the_dockerfile_installs_torch_as_make_install_does() -> None:
    def pins(path: Path) -> set[str]:
        return set(re.findall(r"torch==[0-9.]+", path.read_text()))

    assert pins(ROOT / "Dockerfile") == pins(ROOT / "Makefile") == {"torch==2.13.0"}
