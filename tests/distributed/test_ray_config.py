"""The --ray flags: parsed, checked before anything starts, and turned into Serve's deployment options."""

from __future__ import annotations

import pytest

from pagedserve.distributed.config import RayConfig, check_ray_args, check_ray_flags_need_ray
from pagedserve.distributed.serve_args import serve_args
from pagedserve.distributed.routing_policy import RouterConfig
from pagedserve.entrypoints.cli import build_parser


def parse(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_the_ray_flags_reach_the_config():
    args = parse("--ray", "--num-replicas", "3", "--ray-address", "auto", "--router", "round-robin",
                 "--router-imbalance-threshold", "2", "--ray-cpus-per-replica", "0.5", "--max-num-seqs", "8")
    config = RayConfig.from_args(args)
    assert (config.num_replicas, config.address, config.cpus_per_replica) == (3, "auto", 0.5)
    assert config.router == RouterConfig("round-robin", 2)
    assert config.scaling_options() == {"num_replicas": 3}
    assert config.max_ongoing_requests == 64


def test_autoscaling_targets_waiting_requests_beyond_the_running_batch():
    config = RayConfig.from_args(parse("--autoscale-min", "1", "--autoscale-max", "4", "--max-num-seqs", "16",
                                       "--autoscale-target-waiting", "3"))
    scaling = config.scaling_options()["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (1, 4, 1)
    assert scaling["target_ongoing_requests"] == 16 + 3


@pytest.mark.parametrize("flags,match", [(["--num-replicas", "0"], "num-replicas"),
                                         (["--autoscale-min", "1"], "go together"),
                                         (["--autoscale-min", "3", "--autoscale-max", "2"], "autoscale-min"),
                                         (["--autoscale-min", "0", "--autoscale-max", "2"], "autoscale-min"),
                                         (["--autoscale-target-waiting", "-1"], "target-waiting"),
                                         (["--ray-gpus-per-replica", "-1"], "gpus")])
def test_bad_ray_flags_are_refused_with_the_flag_named(flags, match):
    with pytest.raises(ValueError, match=match):
        RayConfig.from_args(parse(*flags))


def test_what_ray_does_not_serve_yet_is_refused_before_start():
    check_ray_args(parse("--enable-lora", "--lora-modules", "a=/adapters/a"))  # adapters loaded at start: served
    with pytest.raises(ValueError, match="allow-runtime-lora-updating"):
        check_ray_args(parse("--enable-lora", "--allow-runtime-lora-updating"))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        check_ray_args(parse("--lora-modules", "a=/adapters/a"))
    with pytest.raises(ValueError, match="TLS"):
        check_ray_args(parse("--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"))


def test_serve_run_style_arguments_parse_like_the_command_line():
    args = serve_args({"model": "/m", "num-replicas": "2", "dtype": "float32", "enable_prefix_caching": "true",
                       "served_model_name": ["a", "b"]}, router="least-loaded")
    assert (args.model, args.num_replicas, args.dtype, args.router) == ("/m", 2, "float32", "least-loaded")
    assert args.served_model_name == ["a", "b"]
    assert serve_args({"api_key": ["k1", "k2"]}).api_key == ["k1", "k2"]  # a repeated flag
    assert serve_args({"enable_prefix_caching": "false"}).enable_prefix_caching is False  # --no-...
    assert serve_args({"enable_chunked_prefill": False}).enable_chunked_prefill is False
    with pytest.raises(ValueError, match="bad pagedserve serve arguments"):
        serve_args({"no_such_flag": "1"})


def test_the_example_serve_config_and_rayservice_build_the_app():
    import os

    import yaml

    pytest.importorskip("ray", reason="building the Ray app needs ray[serve]")
    from pagedserve.ray import build_app

    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "ray")
    with open(os.path.join(root, "serve_config.yaml")) as f:
        [config] = yaml.safe_load(f)["applications"]
    with open(os.path.join(root, "rayservice.yaml")) as f:
        [service] = yaml.safe_load(yaml.safe_load(f)["spec"]["serveConfigV2"])["applications"]
    for app in (config, service):
        assert app["import_path"] == "pagedserve.ray:build_app" and app["route_prefix"] == "/"
        args = serve_args(app["args"])
        assert (args.num_replicas, args.router, args.ray_cpus_per_replica) == (2, "prefix", 2.0)
        assert build_app(app["args"]) is not None  # the application graph builds (nothing runs until deployed)


def test_ray_flags_without_ray_are_refused_not_ignored():
    defaults = parse()
    check_ray_flags_need_ray(parse("--ray", "--num-replicas", "2"), defaults)
    check_ray_flags_need_ray(parse("--port", "9000"), defaults)
    with pytest.raises(ValueError, match="--num-replicas, --router only apply with --ray"):
        check_ray_flags_need_ray(parse("--num-replicas", "2", "--router", "round-robin"), defaults)
