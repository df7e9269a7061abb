"""The Ray Serve application: RayConfig (the --ray flags), build_app (ingress -> engine replicas, with the
router and autoscaling), and serve_on_ray, what `pagedserve serve --ray` runs."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Optional, Union

from pagedserve.config import SchedulerConfig
from pagedserve.distributed.routing_policy import RouterConfig
from pagedserve.entrypoints.engine_args import engine_kwargs

logger = logging.getLogger("pagedserve.serve")

APP_NAME = "pagedserve"
DEFAULT_TARGET_WAITING = 2


@dataclass(frozen=True)
class RayConfig:
    num_replicas: int = 1
    """Engine replicas (the initial count when autoscaling)."""
    address: Optional[str] = None
    """The Ray cluster to join ('auto': the one `ray start` began on this machine); None starts a local one."""
    autoscale_min: Optional[int] = None
    autoscale_max: Optional[int] = None
    autoscale_target_waiting: int = DEFAULT_TARGET_WAITING
    """Waiting requests per replica that the autoscaler aims at (above max_num_seqs running ones)."""
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    router: RouterConfig = field(default_factory=RouterConfig)
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    shutdown_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1, got {self.num_replicas}")
        if (self.autoscale_min is None) != (self.autoscale_max is None):
            raise ValueError("--autoscale-min and --autoscale-max go together: give both to autoscale, or neither")
        if self.autoscale_min is not None and not 0 <= self.autoscale_min <= self.autoscale_max:
            raise ValueError(f"need 0 <= --autoscale-min <= --autoscale-max, got {self.autoscale_min} and "
                             f"{self.autoscale_max}")
        if self.autoscale_max is not None and self.autoscale_max < 1:
            raise ValueError(f"--autoscale-max must be >= 1, got {self.autoscale_max}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("--ray-cpus-per-replica and --ray-gpus-per-replica must be >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RayConfig":
        router = RouterConfig(args.router, args.router_imbalance_threshold)
        return cls(args.num_replicas, args.ray_address, args.autoscale_min, args.autoscale_max,
                   args.autoscale_target_waiting, args.ray_cpus_per_replica, args.ray_gpus_per_replica, router,
                   args.max_num_seqs, args.shutdown_timeout)

    @property
    def max_ongoing_requests(self) -> int:
        """Ray's cap on one replica's requests: high, since the engine queues and schedules them itself."""
        return max(4 * self.max_num_seqs, 64)

    def scaling_options(self) -> dict:
        """The engine deployment's replica count, or Ray Serve's autoscaling config. A replica's ongoing
        requests are its running (up to max_num_seqs) and waiting ones: the target is set in waiting ones."""
        if self.autoscale_min is None:
            return {"num_replicas": self.num_replicas}
        return {"autoscaling_config": {
            "min_replicas": self.autoscale_min, "max_replicas": self.autoscale_max,
            "initial_replicas": min(max(self.num_replicas, self.autoscale_min), self.autoscale_max),
            "target_ongoing_requests": self.max_num_seqs + self.autoscale_target_waiting,
            "metrics_interval_s": 2.0, "look_back_period_s": 10.0, "upscale_delay_s": 5.0,
            "downscale_delay_s": 60.0}}


def check_ray_args(args: argparse.Namespace) -> None:
    """What --ray does not serve yet, refused before anything starts."""
    if getattr(args, "allow_runtime_lora_updating", False):
        raise ValueError("--ray serves the --lora-modules given at start (every replica loads them); it has no "
                         "--allow-runtime-lora-updating yet")
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    if getattr(args, "ssl_keyfile", None) or getattr(args, "ssl_certfile", None):
        raise ValueError("--ray serves plain HTTP (Ray Serve's proxy): terminate TLS in front of it")


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
    quiet = {"enable_access_log": False}  # Serve would log every call: every report, every token stream
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
           list(args.lora_modules or []))
    return serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=1 << 16, graceful_shutdown_timeout_s=ray_config.shutdown_timeout,
                            logging_config=quiet,
                            ).bind(args, engine, board)


def serve_args(args: Union[argparse.Namespace, dict, None] = None, **overrides) -> argparse.Namespace:
    """`pagedserve serve` args from a Namespace, or from flag names (dashes or underscores) and values, parsed
    as the command line would be (ValueError naming what is wrong)."""
    from pagedserve.entrypoints.cli import build_parser

    if isinstance(args, argparse.Namespace):
        return argparse.Namespace(**{**vars(args), **overrides})
    parser = build_parser()
    repeated = {a.dest for a in _serve_parser(parser)._actions if isinstance(a, argparse._AppendAction)}
    argv = ["serve"]
    for key, value in {**(args or {}), **overrides}.items():
        flag = "--" + key.replace("_", "-")
        if value is True or value in ("true", "True"):
            argv.append(flag)
        elif value is False or value in ("false", "False") or value is None:
            continue
        elif isinstance(value, (list, tuple)) and key.replace("-", "_") in repeated:
            for item in value:
                argv += [flag, str(item)]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed what is wrong
        raise ValueError(f"bad pagedserve serve arguments {argv[1:]}: {e}") from None


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices["serve"]


def serve_on_ray(args: argparse.Namespace) -> int:
    """`pagedserve serve --ray`: join or start a Ray cluster, run the app behind Serve's HTTP proxy on
    --host/--port, and on SIGTERM/SIGINT shut Serve down (every replica drains, up to --shutdown-timeout).
    SIGHUP re-reads the keys file in the ingress."""
    import ray
    from ray import serve

    check_ray_args(args)
    RayConfig.from_args(args)  # flag errors before the cluster starts
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()
    # Ours, not the handler ray.init installed (which tears the node down at once), and before Serve's proxy
    # answers: a SIGTERM at any point from here on drains.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=_reload_keys, daemon=True).start())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("pagedserve is ready on Ray Serve: http://%s:%d/v1 (%d engine replica(s), router %s)",
                    args.host, args.port, args.num_replicas, args.router)
        stop.wait()
        logger.info("shutting down: waiting up to %.0f s for the requests in flight", args.shutdown_timeout)
        left = serve.get_app_handle(APP_NAME).drain.remote(args.shutdown_timeout).result(
            timeout_s=args.shutdown_timeout + 30)
        if left:
            logger.warning("%d request(s) still running after --shutdown-timeout: cancelled", left)
    finally:
        serve.shutdown()
        ray.shutdown()
        logger.info("pagedserve stopped")
    return 0


def _reload_keys() -> None:
    from ray import serve

    try:
        serve.get_app_handle(APP_NAME).reload_keys.remote().result(timeout_s=30)
        logger.info("keys file re-read")
    except Exception:  # noqa: BLE001 - a bad keys file keeps the old keys; say why
        logger.exception("could not re-read the keys file")
