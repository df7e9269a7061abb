"""The Dockerfile and docker-compose.yml, read as files (no container is built here: there is no Docker daemon):
the image installs with the README's own command, runs as a non-root user, checks /health and lets SIGTERM
reach the server; the compose file parses and mounts only files that exist."""

from __future__ import annotations

import json
import os
import re

from deploy_files import DEPLOY, ROOT, load_yaml
from pagedserve.entrypoints.cli import _serve_parser, build_parser
from pagedserve.entrypoints.config_file import expand_config_file

SERVE_SUFFIX = " && pagedserve serve"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    with open(os.path.join(ROOT, "Dockerfile"), encoding="utf-8") as f:
        text = re.sub(r"\\\n", " ", "".join(line for line in f if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in text.splitlines()
            if line.strip()]


def readme_serve_command() -> str:
    """The README's first command: the one that serves the default model on a fresh machine."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.search(r"```bash\n(.+?)\n```", f.read()).group(1).strip()


def test_the_image_installs_with_the_readme_command():
    command = readme_serve_command()
    assert command.endswith(SERVE_SUFFIX)
    runs = [args for instruction, args in dockerfile_instructions() if instruction == "RUN"]
    assert command[:-len(SERVE_SUFFIX)] in runs


def test_the_image_runs_pagedserve_serve_as_pid_1_as_a_non_root_user_with_a_health_check():
    instructions = dict(dockerfile_instructions())
    assert json.loads(instructions["ENTRYPOINT"]) == ["pagedserve", "serve"]  # exec form: SIGTERM reaches it
    assert instructions["STOPSIGNAL"] == "SIGTERM"
    assert instructions["USER"] not in ("root", "0")
    assert "/health" in instructions["HEALTHCHECK"] and "--start-period" in instructions["HEALTHCHECK"]
    args = build_parser().parse_args(["serve", *json.loads(instructions["CMD"])])
    assert args.host == "0.0.0.0" and str(args.port) in instructions["EXPOSE"]


def test_compose_mounts_only_files_that_exist_and_builds_from_the_dockerfile():
    compose = load_yaml(os.path.join(DEPLOY, "docker-compose.yml"))
    assert set(compose["services"]) == {"pagedserve", "prometheus", "grafana"}
    build = compose["services"]["pagedserve"]["build"]
    assert os.path.isfile(os.path.join(DEPLOY, build["context"], build["dockerfile"]))
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert os.path.exists(os.path.join(DEPLOY, source)), f"{name} mounts {source}, which is not there"


def test_compose_runs_a_valid_config_and_gives_the_drain_time_to_finish():
    service = load_yaml(os.path.join(DEPLOY, "docker-compose.yml"))["services"]["pagedserve"]
    mounts = dict(v.split(":")[:2][::-1] for v in service["volumes"])
    argv = ["serve", *(os.path.join(DEPLOY, mounts[a]) if a in mounts else a for a in service["command"])]
    args = build_parser().parse_args(expand_config_file(_serve_parser(), argv))
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert float(service["stop_grace_period"].rstrip("s")) > args.shutdown_timeout


def test_prometheus_in_compose_loads_the_shipped_rules():
    service = load_yaml(os.path.join(DEPLOY, "docker-compose.yml"))["services"]["prometheus"]
    mounts = dict(v.split(":")[:2][::-1] for v in service["volumes"])
    config = load_yaml(os.path.join(DEPLOY, mounts["/etc/prometheus/prometheus.yml"]))
    assert config["rule_files"] == ["rules/*.yml"] and mounts["/etc/prometheus/rules"] == "./prometheus/rules"
    assert {job["static_configs"][0]["targets"][0] for job in config["scrape_configs"]} == {"pagedserve:8000"}
