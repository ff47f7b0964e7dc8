"""docker-compose.yml and the Dockerfile, checked for consistency (no Docker engine here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tokenfleet.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_compose_has_every_service_of_the_fleet() -> None:
    assert {"redis", "ray-head", "ray-worker", "scheduler", "gateway"} <= set(SERVICES)
    assert "--appendonly" in SERVICES["redis"]["command"]
    assert SERVICES["gateway"]["ports"] == ["8000:8000"]
    for name, service in SERVICES.items():
        assert service.get("restart"), f"{name} has no restart policy"


@pytest.mark.parametrize("name", ["scheduler", "gateway"])
def test_tokenfleet_services_run_real_commands_with_real_flags(name: str) -> None:
    command = SERVICES[name]["command"]
    args = build_parser().parse_args(command)  # exits (fails the test) on an unknown flag
    assert args.command == name
    assert args.redis_url == "redis://redis:6379/0"  # the compose service named redis
    models = args.model if isinstance(args.model, list) else [args.model]  # the gateway's repeats
    assert all(Path(m).parent.as_posix() == "/data/models" for m in models)  # the shared volume
    assert "models:/data" in SERVICES[name]["volumes"]


def test_services_point_at_each_other() -> None:
    scheduler = build_parser().parse_args(SERVICES["scheduler"]["command"])
    assert scheduler.ray_address == "ray-head:6379"
    assert "--port=6379" in SERVICES["ray-head"]["command"]
    assert "--address=ray-head:6379" in SERVICES["ray-worker"]["command"]
    for name in ("scheduler", "gateway"):
        assert "redis" in SERVICES[name]["depends_on"]
    assert SERVICES["scheduler"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    gateway = build_parser().parse_args(SERVICES["gateway"]["command"])
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8000)


def test_the_cluster_profile_runs_the_fleet_on_a_six_node_redis_cluster() -> None:
    nodes = [name for name in SERVICES if name.startswith("redis-node-")]
    assert len(nodes) == 6
    for name in [*nodes, "redis-cluster-init", "scheduler-cluster", "gateway-cluster"]:
        assert SERVICES[name]["profiles"] == ["cluster"]  # `docker compose up` alone leaves them out
    assert all("--cluster-enabled" in SERVICES[n]["command"] for n in nodes)
    assert "--cluster-replicas 1" in SERVICES["redis-cluster-init"]["command"][0]
    for name in ("scheduler-cluster", "gateway-cluster"):
        args = build_parser().parse_args(SERVICES[name]["command"])
        assert args.redis_url.startswith("redis+cluster://redis-node-1:7000,")
        assert SERVICES[name]["depends_on"]["redis-cluster-init"]["condition"] == \
            "service_completed_successfully"


def test_dockerfile_installs_the_project_and_runs_tokenfleet() -> None:
    import tomllib

    dockerfile = (ROOT / "Dockerfile").read_text()
    # Every package pyproject installs (the `tokenfleet` entry point's own among them).
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = [pattern.rstrip("*") for pattern in found["include"]]
    assert "tokenfleet" in packages
    for package in packages:
        assert f"COPY {package} {package}" in dockerfile
    assert "-c scripts/constraints.txt" in dockerfile and "COPY scripts/constraints.txt" in dockerfile
    assert 'ENTRYPOINT ["tokenfleet"]' in dockerfile


def test_prometheus_and_grafana_are_optional_and_scrape_the_gateway() -> None:
    for name in ("prometheus", "grafana"):
        assert SERVICES[name]["profiles"] == ["monitoring"]  # `docker compose up` alone leaves them out
    for service in ("prometheus", "grafana"):
        for volume in SERVICES[service]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), volume
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    gateway = build_parser().parse_args(SERVICES["gateway"]["command"])
    assert job["static_configs"][0]["targets"] == [f"gateway:{gateway.port}"]


def test_every_metric_the_dashboard_queries_is_one_the_fleet_serves() -> None:
    import json
    import re

    from prometheus_client import generate_latest

    from gateway.core.metrics import GatewayMetrics
    from scheduler.engine_metrics import EngineMetrics
    from scheduler.scheduler import Scheduler, SchedulerConfig

    gateway = GatewayMetrics()
    for model in ("m",):  # labelled series appear once touched
        gateway.queue_depth.labels(model).set(0)
        gateway.live_schedulers.labels(model).set(0)
        gateway.ttft.labels(model).observe(0.1)
        gateway.itl.labels(model).observe(0.1)
    engine = EngineMetrics(Scheduler(SchedulerConfig(max_model_len=8, num_kv_blocks=1)), "m", "s")
    served = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", (generate_latest(gateway.registry)
                                                                    + engine.exposition()).decode(), re.M))
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/tokenfleet.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"(tokenfleet[a-z_:]*)", expr)}
    assert queried and queried <= served, queried - served
    assert {"tokenfleet:num_requests_waiting", "tokenfleet:kv_cache_usage_perc",
            "tokenfleet:generation_tokens_total"} <= queried
