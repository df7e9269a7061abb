"""One small Ray cluster per test module (4 logical CPUs on the machine's 2 cores) and the pagedserve Ray app
deployed on it over the tiny Llama, behind Serve's HTTP proxy on a free port."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="the Ray tests need ray[serve] (pip install 'pagedserve[ray]')")
from ray import serve  # noqa: E402

from pagedserve.distributed.app import APP_NAME  # noqa: E402
from pagedserve.ray import build_app  # noqa: E402

MODEL_NAME = "tiny"
ENGINE_FLAGS = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 23, "max_model_len": 256,
                "served_model_name": [MODEL_NAME, "other-name"], "disable_log_requests": True}


@dataclass
class RayApp:
    url: str
    admin_headers: Optional[dict] = None
    """Headers that /metrics needs (with API keys)."""

    @property
    def async_llm(self) -> "RayApp":
        return self  # what the single-server tests read: `.stats` (summed over the replicas)

    @property
    def stats(self) -> SimpleNamespace:
        text = httpx.get(self.url + "/metrics", headers=self.admin_headers, timeout=30).text
        total = {"running": 0.0, "waiting": 0.0}
        for family in text_string_to_metric_families(text):
            for kind in total:
                if family.name == f"pagedserve:num_requests_{kind}":
                    total[kind] += sum(s.value for s in family.samples)
        return SimpleNamespace(num_running=int(total["running"]), num_waiting=int(total["waiting"]))

    def wait_idle(self, timeout: float = 10.0) -> float:
        start = time.monotonic()
        while (lambda s: s.num_running + s.num_waiting)(self.stats):
            assert time.monotonic() - start < timeout, "requests still running"
            time.sleep(0.05)
        return time.monotonic() - start

    def replica_actor(self, replica_id: str):
        from ray.serve._private.common import DeploymentID, ReplicaID

        name = ReplicaID(replica_id, DeploymentID("EngineReplica", APP_NAME)).to_full_id_str()
        return ray.get_actor(name, namespace="serve")

    def running_replicas(self) -> int:
        deployment = serve.status().applications[APP_NAME].deployments["EngineReplica"]
        return deployment.replica_states.get("RUNNING", 0)

    def wait_replicas(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.running_replicas() != count or len(self.reporting_replicas()) != count:
            assert time.monotonic() < deadline, (f"the app did not get to {count} replica(s): Serve says "
                                                 f"{serve.status().applications[APP_NAME].deployments}, /metrics "
                                                 f"has {self.reporting_replicas()}")
            time.sleep(0.5)

    def reporting_replicas(self) -> set[str]:
        text = httpx.get(self.url + "/metrics", headers=self.admin_headers, timeout=30).text
        return {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("pagedserve:num_requests_running{")}


def free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def start_cluster() -> int:
    """A local cluster and Serve's proxy; returns the proxy's port. The port is picked once the cluster runs, and
    again if the proxy cannot bind it (one of Ray's own processes can take a port between the probe and the
    bind). A failure shuts the cluster down, so that the next module starts clean."""
    ray.init(num_cpus=4, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False)
    try:
        for attempt in range(3):
            port = free_port()
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                return port
            except Exception:  # noqa: BLE001 - the bind failed: another port
                serve.shutdown()
                if attempt == 2:
                    raise
    except BaseException:
        ray.shutdown()
        raise
    raise AssertionError("unreachable")


def deploy(port: int, model_dir: str, **flags) -> RayApp:
    """The app with these `pagedserve serve` flags (replacing the one deployed before), once Serve calls it
    running (its replicas may still be reporting in: see RayApp.wait_replicas)."""
    serve.run(build_app({"model": model_dir, **ENGINE_FLAGS, **flags}), name=APP_NAME, route_prefix="/",
              blocking=False)
    app = RayApp(f"http://127.0.0.1:{port}")
    return app


def stop_cluster() -> None:
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_port():
    port = start_cluster()
    yield port
    stop_cluster()
