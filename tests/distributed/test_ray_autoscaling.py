"""Waiting requests make Ray Serve's autoscaler add an engine replica, up to --autoscale-max.

A cluster of its own: with ray 2.60, redeploying in one cluster between an autoscaling and a fixed replica count
(either way) left the deployment without autoscaling or without answers; a user's app is deployed once."""

from __future__ import annotations

import asyncio
import threading

import httpx

from ray_cluster import MODEL_NAME, deploy, ray_port  # noqa: F401 - fixture


def test_waiting_requests_scale_the_replicas_up_within_the_bounds(ray_port, tiny_llama_dir):
    app = deploy(ray_port, tiny_llama_dir, autoscale_min=1, autoscale_max=2, autoscale_target_waiting=1,
                 max_num_seqs=1, max_model_len=1024)
    app.wait_replicas(1)

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=app.url, timeout=300) as http:
            body = {"model": MODEL_NAME, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*[http.post("/v1/completions", json={**body, "prompt": [5 + i, 6]})
                                          for i in range(16)])

    thread = threading.Thread(target=lambda: results.extend(asyncio.run(flood())))
    results: list = []
    thread.start()
    app.wait_replicas(2, timeout=90)  # 1 running + 15 waiting on one replica: far above its target of 1 + 1
    thread.join(300)
    assert len(results) == 16 and all(r.status_code == 200 for r in results)
    assert app.running_replicas() == 2  # never above --autoscale-max
