"""`pagedserve.ray:build_app`: the Ray Serve application (ingress + engine replicas) for `serve run`, a Serve
config file or a KubeRay RayService; `pagedserve serve --ray` runs the same app."""

from pagedserve.distributed.app import build_app
from pagedserve.distributed.config import RayConfig
from pagedserve.distributed.serve_args import serve_args

__all__ = ["RayConfig", "build_app", "serve_args"]
