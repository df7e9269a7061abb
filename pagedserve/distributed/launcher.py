"""`pagedserve serve --ray`: the cluster, Serve's proxy, the app, and a shutdown that drains."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from pagedserve.distributed.app import APP_NAME, build_app
from pagedserve.distributed.config import check_ray_args

logger = logging.getLogger("pagedserve.serve")


def serve_on_ray(args: argparse.Namespace) -> int:
    """`pagedserve serve --ray`: join or start a Ray cluster, run the app behind Serve's HTTP proxy on
    --host/--port, and on SIGTERM/SIGINT shut Serve down (every replica drains, up to --shutdown-timeout).
    SIGHUP re-reads the keys file in the ingress."""
    import ray
    from ray import serve

    check_ray_args(args)  # flag errors before the cluster starts
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
        if serve.get_app_handle(APP_NAME).reload_keys.remote().result(timeout_s=30):
            logger.info("keys file re-read")
        else:
            logger.warning("the keys file was not re-read (no --api-keys-file, or it is invalid: the old keys "
                           "stay); see the ingress's log")
    except Exception:  # noqa: BLE001 - a bad keys file keeps the old keys; say why
        logger.exception("could not re-read the keys file")
