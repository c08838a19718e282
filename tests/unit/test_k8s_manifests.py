"""The Kubernetes manifests in docs/deploy/k8s, offline: every object valid against the Kubernetes
schemas (``kubernetes-validate``'s bundled ones, strict: no unknown field), every file listed by the
kustomization, and the manifests agreeing with tandem itself: the cloud's TOML is settings
``CloudConfig`` knows, probes, ports and the scrape annotation name the ports it configures, the
grace period covers the preStop pause and ``drain_grace_s``, the GPUs requested are
``tensor_parallel_size``, and the edge's ``dns:`` target names the headless Service."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.cloud.config import CloudConfig, EngineConfig
from tandem.common.runtime.grpc_setup import LIVENESS_SERVICE
from tandem.edge.config import EdgeConfig
from tandem.edge.link.discovery import parse_dns_target
from tests.helpers import ROOT

K8S = ROOT / "docs" / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # the oldest release the manifests are checked against (preStop sleep: 1.30)
ENGINE_DRAIN_S = 30  # the engines' own shutdown after the drain (SIGTERM to vLLM's processes)


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def objects() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in kustomization()["resources"]:
        out += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return out


def find(kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name)


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def cloud_toml() -> dict[str, Any]:
    return tomllib.loads(find("ConfigMap", "tandem-cloud-config")["data"]["cloud.toml"])


def test_the_kustomization_lists_every_manifest():
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) == files


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, "1.37.0"])
def test_every_object_is_valid_against_the_kubernetes_schemas(version):
    import kubernetes_validate

    objs = objects()
    assert {o["kind"] for o in objs} >= {"Deployment", "Service", "ConfigMap", "StatefulSet", "Job"}
    for o in objs:
        kubernetes_validate.validate(o, version, strict=True)


def test_a_manifest_with_an_unknown_field_fails_validation():
    import kubernetes_validate

    bad = find("Service", "tandem-cloud")
    bad["spec"]["clusterIp"] = "None"  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_cloud_config_is_settings_tandem_cloud_knows():
    conf = cloud_toml()
    unknown = set(conf) - set(CloudConfig.model_fields)
    assert not unknown, f"not CloudConfig settings: {unknown}"
    assert not set(conf["engine"]) - set(EngineConfig.model_fields)
    # the values pass the settings' own checks (TLS files and the split directory exist only in the pod)
    CloudConfig.model_validate({k: v for k, v in conf.items() if not k.startswith("tls_")} | {"insecure": True})


def test_the_cloud_deployment_matches_its_config():
    conf, cloud = cloud_toml(), find("Deployment", "tandem-cloud")
    c, pod = container(cloud, "tandem-cloud"), cloud["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": conf["port"], "health": conf["health_port"], "metrics": conf["metrics_port"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == conf["health_port"]  # the plaintext health-only port
    assert c["readinessProbe"]["grpc"]["service"] == "tandem.v1.Cloud"  # NOT_SERVING while draining
    assert c["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE  # SERVING through a drain
    pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pause + conf["drain_grace_s"] + ENGINE_DRAIN_S
    gpus = conf["engine"]["tensor_parallel_size"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus) == c["resources"]["requests"]["nvidia.com/gpu"]
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == conf["metrics_port"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secret = next(v for v in pod["spec"]["volumes"] if v["name"] == "tls")["secret"]["secretName"]
    assert secret == "tandem-cloud-tls" and Path(conf["tls_cert_file"]).parent == Path(mounts["tls"])
    assert conf["store_url"].startswith("redis+cluster://")
    env = {e["name"] for e in c["env"]}
    assert {"TANDEM_CLOUD_EDGE_KEYS", "TANDEM_CLOUD_STORE_PASSWORD"} <= env  # secrets never in the ConfigMap


def test_the_headless_service_selects_the_cloud_and_its_grpc_port():
    svc, cloud = find("Service", "tandem-cloud"), find("Deployment", "tandem-cloud")
    assert svc["spec"]["clusterIP"] == "None"
    labels = cloud["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    (port,) = svc["spec"]["ports"]
    assert port["port"] == cloud_toml()["port"]


def test_the_edge_finds_the_cloud_through_the_headless_service():
    edge = container(find("Deployment", "chat-app"), "tandem-edge")
    env = {e["name"].removeprefix("TANDEM_EDGE_").lower(): e.get("value") for e in edge["env"]}
    unknown = set(env) - set(EdgeConfig.model_fields)
    assert not unknown, f"not EdgeConfig settings: {unknown}"
    name = parse_dns_target(env["cloud_target"])
    assert name is not None and name.port == cloud_toml()["port"]
    assert name.host == f"tandem-cloud.{kustomization()['namespace']}.svc.cluster.local"
    assert env["cloud_ca_file"]  # TLS to the cloud; its certificate carries the Service's name


def test_the_redis_cluster_has_three_primaries_with_a_replica_each():
    redis = find("StatefulSet", "tandem-redis")
    assert redis["spec"]["replicas"] == 6
    job = container(find("Job", "tandem-redis-cluster-create"), "create")
    assert "--cluster-replicas 1" in job["command"][-1]
    hosts = cloud_toml()["store_url"].removeprefix("redis+cluster://").split(",")
    assert all(h.startswith("tandem-redis-") and h.endswith(".tandem-redis:6379") for h in hosts)
