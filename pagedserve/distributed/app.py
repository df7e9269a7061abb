"""The Ray Serve application: build_app (ingress -> engine replicas, with the router and autoscaling) for
`pagedserve serve` args."""

from __future__ import annotations

import argparse
from typing import Union

from pagedserve.distributed.config import RayConfig, check_ray_args
from pagedserve.distributed.serve_args import serve_args
from pagedserve.entrypoints.engine_args import engine_kwargs
from pagedserve.logging_utils import LoggingConfig

APP_NAME = "pagedserve"


def build_app(args: Union[argparse.Namespace, dict, None] = None, **overrides):
    """The Ray Serve application for `pagedserve serve` args: a Namespace, or a dict of flag names to values
    (what `serve run pagedserve.ray:build_app model=... num_replicas=2` passes), or keyword arguments."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedserve.distributed.engine_replica import EngineReplica
    from pagedserve.distributed.ingress import OpenAIIngress
    from pagedserve.distributed.replica_board import ReplicaBoard
    from pagedserve.distributed.request_router import PagedServeRequestRouter
    from pagedserve.entrypoints.openai.api_server import server_config

    args = serve_args(args, **overrides)
    check_ray_args(args)
    ray_config = RayConfig.from_args(args)
    router = ray_config.router
    # Serve's access log would log every call (every report, every token stream): the ingress writes its own.
    quiet = {"enable_access_log": False, "encoding": "JSON" if getattr(args, "log_format", "text") == "json"
             else "TEXT", "log_level": getattr(args, "log_level", "info").upper()}
    board = serve.deployment(ReplicaBoard, name="ReplicaBoard", ray_actor_options={"num_cpus": 0},
                             logging_config=quiet).bind()
    engine = serve.deployment(
        EngineReplica, name="EngineReplica", max_ongoing_requests=ray_config.max_ongoing_requests,
        ray_actor_options={"num_cpus": ray_config.cpus_per_replica, "num_gpus": ray_config.gpus_per_replica},
        graceful_shutdown_timeout_s=ray_config.shutdown_timeout, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2.0, health_check_timeout_s=30.0, logging_config=quiet,
        request_router_config=RequestRouterConfig(
            request_router_class=PagedServeRequestRouter,
            request_router_kwargs={"policy": router.policy, "imbalance_threshold": router.imbalance_threshold,
                                   "index_capacity": router.index_capacity}),
        **ray_config.scaling_options(),
    ).bind(engine_kwargs(args), args.max_num_queued_requests, server_config(args).served_model_names[0], board,
           list(args.lora_modules or []), LoggingConfig(args.log_level, args.log_format))
    return serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=1 << 16, graceful_shutdown_timeout_s=ray_config.shutdown_timeout,
                            logging_config=quiet,
                            ).bind(args, engine, board)
