"""The Kubernetes manifests: both overlays render (kubectl kustomize when installed, else kustomize_render,
which is checked against kubectl where both exist) and validate against the Kubernetes schemas; the pieces fit
together (probes on /health, grace period above --shutdown-timeout, the ConfigMap a valid --config file, the
Secret a valid keys file, the autoscalers aimed at the Deployment)."""

from __future__ import annotations

import os
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from deploy_files import KUBERNETES, PROMETHEUS_DIR, load_yaml
from kustomize_render import render
from pagedserve.entrypoints.cli import _serve_parser, build_parser
from pagedserve.entrypoints.config_file import expand_config_file
from pagedserve.tenants.keys_file import load_tenants

KUBERNETES_VERSION = "1.34.0"
OVERLAYS = ["cpu", "gpu"]
BUILT_IN = ("v1", "apps/v1", "policy/v1", "autoscaling/v2")


def overlay(name: str) -> str:
    return os.path.join(KUBERNETES, "overlays", name)


def objects(name: str) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render(overlay(name))}


@pytest.mark.parametrize("name", OVERLAYS)
def test_an_overlay_renders_the_deployment_service_config_secret_pdb_and_autoscaler(name):
    assert set(objects(name)) == {("ConfigMap", "pagedserve-config"), ("Secret", "pagedserve-api-keys"),
                                  ("Deployment", "pagedserve"), ("Service", "pagedserve"),
                                  ("PodDisruptionBudget", "pagedserve"), ("ScaledObject", "pagedserve"),
                                  ("PodMonitor", "pagedserve")}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the renderer is checked "
                    "against it where it is")
@pytest.mark.parametrize("name", OVERLAYS)
def test_the_renderer_matches_kubectl_kustomize(name):
    done = subprocess.run(["kubectl", "kustomize", overlay(name)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    by_kubectl = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(done.stdout) if o}
    assert by_kubectl == objects(name)


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_built_in_object_validates_against_the_kubernetes_schemas(name):
    for (kind, _), obj in objects(name).items():
        if obj["apiVersion"] in BUILT_IN:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        else:
            assert (kind, obj["apiVersion"]) in (("ScaledObject", "keda.sh/v1alpha1"),  # CRDs: checked below
                                                 ("PodMonitor", "monitoring.coreos.com/v1"))


def test_the_hpa_alternative_validates_and_targets_the_deployment():
    hpa = load_yaml(os.path.join(KUBERNETES, "autoscaling", "hpa", "hpa.yaml"))
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedserve"}
    values = load_yaml(os.path.join(KUBERNETES, "autoscaling", "hpa", "prometheus-adapter-values.yaml"))
    [rule] = values["rules"]["custom"]
    assert rule["name"]["as"] == hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]


def test_the_scaled_object_targets_the_deployment_with_a_prometheus_trigger():
    scaled = objects("cpu")[("ScaledObject", "pagedserve")]
    assert scaled["spec"]["scaleTargetRef"] == {"name": "pagedserve"}
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "pagedserve:num_requests_waiting" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) > 0


def config_args(deployment: dict, config_map: dict, tmp_path):
    """The `pagedserve serve` args the pod runs: its container args with the ConfigMap's file."""
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    argv = ["serve", *(str(path) if a.endswith("config.yaml") else a for a in container["args"])]
    return build_parser().parse_args(expand_config_file(_serve_parser(), argv))


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_pod_runs_a_valid_config_with_probes_on_health_and_time_to_drain(name, tmp_path):
    rendered = objects(name)
    deployment, config_map = rendered[("Deployment", "pagedserve")], rendered[("ConfigMap", "pagedserve-config")]
    args = config_args(deployment, config_map, tmp_path)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert (args.host, args.port) == ("0.0.0.0", container["ports"][0]["containerPort"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_timeout + pre_stop
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert os.path.dirname(container["args"][1]) in mounts and os.path.dirname(args.api_keys_file) in mounts


def test_the_secret_is_a_keys_file_the_server_accepts(tmp_path):
    secret = objects("cpu")[("Secret", "pagedserve-api-keys")]
    path = tmp_path / "keys.toml"
    path.write_text(secret["stringData"]["keys.toml"])
    assert [t.name for t in load_tenants(str(path))] == ["replace-me"]


def test_the_gpu_overlay_asks_for_a_gpu_and_the_cuda_image():
    container = objects("gpu")[("Deployment", "pagedserve")]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1 and container["image"] == "pagedserve:cuda"


def test_the_pod_monitor_scrapes_each_pod_under_the_job_names_the_rules_use():
    rendered = objects("cpu")
    monitor, deployment = rendered[("PodMonitor", "pagedserve")], rendered[("Deployment", "pagedserve")]
    pod = deployment["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    endpoints = {e["path"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"/metrics", "/health"} and all(e["port"] in ports for e in endpoints.values())
    jobs = {path: [r["replacement"] for r in e["relabelings"] if r["targetLabel"] == "job"]
            for path, e in endpoints.items()}
    scrape_jobs = {j["job_name"]: j["metrics_path"] for j in load_yaml(os.path.join(PROMETHEUS_DIR,
                                                                                    "prometheus.yml"))["scrape_configs"]}
    assert {path: job for path, [job] in jobs.items()} == {path: job for job, path in scrape_jobs.items()}
    assert endpoints["/metrics"]["authorization"]["credentials"]["name"] == "pagedserve-scrape-key"


def test_every_path_the_pod_writes_is_a_mounted_volume():
    container = objects("cpu")[("Deployment", "pagedserve")]["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert {env["PAGEDSERVE_CACHE_DIR"], env["HOME"], "/tmp"} <= writable


def test_the_autoscaled_deployment_sets_no_replica_count():
    assert "replicas" not in objects("cpu")[("Deployment", "pagedserve")]["spec"]
