"""RayConfig: the --ray flags, checked before anything starts, and the engine deployment's scaling options."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.config import SchedulerConfig
from pagedserve.distributed.routing_policy import RouterConfig

DEFAULT_TARGET_WAITING = 2
RAY_FLAGS = ("num_replicas", "ray_address", "autoscale_min", "autoscale_max", "autoscale_target_waiting",
             "ray_cpus_per_replica", "ray_gpus_per_replica", "router", "router_imbalance_threshold")
"""The `pagedserve serve` flags that only mean something with --ray."""


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
        # Not 0: with no replica, /health is 503 and nothing would ever bring one back.
        if self.autoscale_min is not None and not 1 <= self.autoscale_min <= self.autoscale_max:
            raise ValueError(f"need 1 <= --autoscale-min <= --autoscale-max, got {self.autoscale_min} and "
                             f"{self.autoscale_max}")
        if self.autoscale_target_waiting < 0:
            raise ValueError(f"--autoscale-target-waiting must be >= 0, got {self.autoscale_target_waiting}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("--ray-cpus-per-replica and --ray-gpus-per-replica must be >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RayConfig":
        return cls(num_replicas=args.num_replicas, address=args.ray_address, autoscale_min=args.autoscale_min,
                   autoscale_max=args.autoscale_max, autoscale_target_waiting=args.autoscale_target_waiting,
                   cpus_per_replica=args.ray_cpus_per_replica, gpus_per_replica=args.ray_gpus_per_replica,
                   router=RouterConfig(args.router, args.router_imbalance_threshold),
                   max_num_seqs=args.max_num_seqs, shutdown_timeout=args.shutdown_timeout)

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
    RayConfig.from_args(args)
    if getattr(args, "allow_runtime_lora_updating", False):
        raise ValueError("--ray serves the --lora-modules given at start (every replica loads them); it has no "
                         "--allow-runtime-lora-updating yet")
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    if getattr(args, "ssl_keyfile", None) or getattr(args, "ssl_certfile", None):
        raise ValueError("--ray serves plain HTTP (Ray Serve's proxy): terminate TLS in front of it")


def check_ray_flags_need_ray(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    """Without --ray, a --ray flag would be silently ignored: refuse it instead."""
    given = [name for name in RAY_FLAGS if getattr(args, name) != getattr(defaults, name)]
    if given and not args.ray:
        raise ValueError(f"{', '.join('--' + n.replace('_', '-') for n in given)} only apply with --ray")
