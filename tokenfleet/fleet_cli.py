"""`tokenfleet up` and `tokenfleet autoscale`: their flags, and the options and command lines they
turn into (the whole fleet as child processes; replicas kept between bounds)."""

from __future__ import annotations

import argparse
import os

from shared.config import DEFAULT_REDIS_URL
from shared.errors import InvalidRequestError
from tokenfleet.engine_flags import (
    add_engine_flags,
    check_executor,
    engine_argv,
    resolve_model,
    scheduler_command,
)
from tokenfleet.flags import REDIS_URL_HELP, ROUTING_MODES
from tokenfleet.flags import flag as _flag
from tokenfleet.flags import flag_table as _flag_table
from tokenfleet.flags import list_flag as _list_flag
from tokenfleet.flags import list_value as _list_value
from tokenfleet.flags import redis_flags as _redis_flags

# The autoscaler's policy and pacing (tokenfleet/autoscale/policy.py): name, type, default, help.
AUTOSCALE_FLAGS = (
    ("target-queue", float, 8.0, "waiting requests per replica above which one is added"),
    ("target-wait-s", float, 5.0, "a request waiting longer than this in the queue adds a replica"),
    ("scale-down-load", float, 0.5,
     "one is removed when the running work fits one replica fewer at this fraction of its slots"),
    ("scale-up-cooldown-s", float, 5.0, "at least this long between additions"),
    ("scale-down-cooldown-s", float, 60.0, "low load for this long before a replica is removed (drained)"),
    ("placement-timeout-s", float, 60.0,
     "a replica Ray cannot place within this is reported (log, tf:replicas:{model}), not awaited"),
    ("drain-timeout-s", float, 300.0,
     "a draining replica's requests still running after this are handed over (takeover)"),
    ("autoscale-interval-s", float, 1.0, "how often the autoscaler looks"),
)


def add_up_parser(commands) -> None:
    up = commands.add_parser("up", help="the whole fleet on this machine: Redis, Ray, schedulers, gateway")
    _flag(up, "host", default="127.0.0.1", help="gateway address")
    _flag(up, "port", type=int, default=8000, help="gateway port")
    _flag(up, "model-name", help="served model name (default: the model folder's name)")
    _flag(up, "replicas", type=int, default=1, help="schedulers (each with its worker group)")
    _redis_flags(up, help="use this Redis instead of starting one (" + REDIS_URL_HELP + ")")
    _flag(up, "redis-port", type=int, help="port of the Redis started here (default: a free one)")
    _flag(up, "redis-cluster", type=int, metavar="N",
          help="start a local Redis Cluster of N primaries and N replicas instead (redis-server >= 7 "
               "on the PATH; for trying one)")
    # Every engine flag, for each replica's scheduler (--ray-address: a Ray `up` joins instead of
    # starting one); the autoscaler reserves the placement groups itself.
    add_engine_flags(up, exclude=("placement-group",))
    _flag(up, "tenants-file", help="the gateway's tenants: API keys and limits (see `tokenfleet gateway`)")
    _flag(up, "tenants-from-redis", action="store_true",
          help="the gateway also looks API keys and tenant limits up in Redis (`tokenfleet tenants set`)")
    _list_flag(up, "api-key", help="a Bearer key the gateway accepts (repeatable; none: the gateway is open)")
    _flag(up, "public-metrics", action="store_true",
          help="the gateway serves /metrics and /fleet.json without a key (see `tokenfleet gateway --help`)")
    _list_flag(up, "lora-root", help="a folder tenants may load LoRA adapters from at runtime "
                                     "(see `tokenfleet gateway --help`)")
    _flag(up, "max-queue", type=int, help="the gateway's waiting requests per model before 429 "
                                          "(default 1024; 0: no limit)")
    _flag(up, "max-n", type=int, help="the gateway's cap on n, choices per request (default 8)")
    _flag(up, "gateway-workers", type=int,
          help="gateway processes on the one port (default: from the cores, max(1, min(8, cores // 4)))")
    _flag(up, "routing", default="prefix", choices=ROUTING_MODES,
          help="the gateway's routing (see `tokenfleet gateway --help`): prefix (the default) or none")
    _flag(up, "batch-ingesters", type=int, default=0,
          help="batch ingester processes besides the one in each gateway process")
    _add_autoscale_flags(up)


def _add_autoscale_flags(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    _flag(parser, "min-replicas", type=int, help="fewest schedulers the autoscaler keeps (default: 1)")
    _flag(parser, "max-replicas", type=int, help="most schedulers the autoscaler starts" + (
        "" if required else "; given (or --min-replicas), replicas follow the load instead of --replicas"))
    _flag_table(parser, AUTOSCALE_FLAGS)

def _autoscale_options(args: argparse.Namespace):
    """The autoscaler's options from the flags, or None when neither bound was given."""
    from tokenfleet.autoscale.policy import ScalingPolicy
    from tokenfleet.autoscale.runner import AutoscaleOptions

    if args.min_replicas is None and args.max_replicas is None:
        return None
    min_replicas = 1 if args.min_replicas is None else args.min_replicas
    max_replicas = max(min_replicas, 1) if args.max_replicas is None else args.max_replicas
    policy = ScalingPolicy(
        min_replicas=min_replicas, max_replicas=max_replicas, target_queue_per_replica=args.target_queue,
        target_wait_s=args.target_wait_s, scale_down_load=args.scale_down_load,
        scale_up_cooldown_s=args.scale_up_cooldown_s, scale_down_cooldown_s=args.scale_down_cooldown_s,
    ).validate()
    for name in ("placement_timeout_s", "drain_timeout_s", "autoscale_interval_s"):
        if getattr(args, name) <= 0:
            flag = name.replace("_", "-")
            raise InvalidRequestError(f"--{flag} must be > 0, got {getattr(args, name)}", param=flag)
    return AutoscaleOptions(policy, interval_s=args.autoscale_interval_s,
                            placement_timeout_s=args.placement_timeout_s,
                            drain_timeout_s=args.drain_timeout_s)


def add_autoscale_parser(commands) -> None:
    auto = commands.add_parser("autoscale", help="keep a model's schedulers between --min-replicas and "
                                                 "--max-replicas from its queue (for a cluster)")
    _redis_flags(auto, default=DEFAULT_REDIS_URL, help="the fleet's Redis")
    _flag(auto, "model-name", help="served model name (default: the model folder's name)")
    add_engine_flags(auto, exclude=("placement-group",), helps={
        "ray-address": "the Ray cluster replicas' groups are placed on (needed with Ray groups)"})
    _flag(auto, "key-prefix", default="tf:", help="prefix of every Redis key")
    _add_autoscale_flags(auto, required=True)
    auto.add_argument("scheduler_args", nargs=argparse.REMAINDER, metavar="-- SCHEDULER FLAGS",
                      help="after --: other flags of every replica's `tokenfleet scheduler` (e.g. --lease-s)")


def autoscale_argv_for(args: argparse.Namespace, model: str, model_name: str):
    """`tokenfleet autoscale`'s (replica_id, placement group) -> that replica's scheduler command
    line: its engine flags, --key-prefix and the flags after `--`."""
    engine_args = engine_argv(args)
    extra = ["--key-prefix", args.key_prefix, *(a for a in args.scheduler_args if a != "--")]

    def argv_for(replica_id: str, group: str | None) -> list[str]:
        return scheduler_command(redis_url=args.redis_url, model=model, model_name=model_name,
                                 scheduler_id=replica_id, tp=args.tp, pp=args.pp, executor=args.executor,
                                 ray_address=args.ray_address, placement_group=group, engine_args=engine_args,
                                 extra=extra)
    return argv_for


def cmd_autoscale(args: argparse.Namespace) -> int:
    import signal
    import threading
    from pathlib import Path

    from shared.config import tokenfleet_home, uses_ray
    from tokenfleet.autoscale.runner import AutoscaleRunner, placement_request

    if args.max_replicas is None:
        raise InvalidRequestError("--max-replicas is required", param="max-replicas")
    check_executor(args.executor)
    options = _autoscale_options(args)
    model = resolve_model(args.model)
    model_name = args.model_name or Path(model).name
    needs_ray = uses_ray(args.executor, args.tp, args.pp)
    if needs_ray and not args.ray_address:
        raise InvalidRequestError("--ray-address is required for replicas on Ray groups", param="ray-address")
    argv_for = autoscale_argv_for(args, model, model_name)
    import torch

    from protocol.keys import keys_for

    placement = placement_request(args.tp * args.pp, on_gpu=torch.cuda.is_available(),
                                  num_cpus_per_rank=args.num_cpus_per_rank, strategy=args.placement_strategy,
                                  timeout_s=options.placement_timeout_s) if needs_ray else None
    runner = AutoscaleRunner(args.redis_url, model_name, options, argv_for, tokenfleet_home() / "logs",
                             env=dict(os.environ), ray_address=args.ray_address, placement=placement,
                             keys=keys_for(args.redis_url, args.key_prefix))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    runner.start()
    try:
        while not stop.wait(0.5):
            if not runner.is_alive():
                return 1
        return 0
    finally:
        runner.stop()


def fleet_options(args: argparse.Namespace):
    """`tokenfleet up`'s flags -> its FleetOptions (InvalidRequestError naming a bad flag)."""
    from pathlib import Path

    from tokenfleet.up import FleetOptions, default_gateway_workers

    for name in ("port", "tp", "pp", "replicas", "gateway_workers", "max_n"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = name.replace("_", "-")
            raise InvalidRequestError(f"--{flag} must be >= 1, got {value}", param=flag)
    if args.batch_ingesters < 0:
        raise InvalidRequestError(f"--batch-ingesters must be >= 0, got {args.batch_ingesters}",
                                  param="batch-ingesters")
    check_executor(args.executor)
    model = resolve_model(args.model)
    autoscale = _autoscale_options(args)
    if autoscale is not None and autoscale.policy.min_replicas < 1:
        # `up` waits for a serving replica before it says the fleet is up.
        raise InvalidRequestError("up needs --min-replicas >= 1 (tokenfleet autoscale allows 0)",
                                  param="min-replicas")
    if args.redis_cluster is not None and (args.redis_url or args.redis_cluster < 1):
        raise InvalidRequestError("--redis-cluster N (N >= 1) starts a Redis Cluster here: give it or "
                                  "--redis-url, not both", param="redis-cluster")
    return FleetOptions(
        autoscale=autoscale, model=model, model_name=args.model_name or Path(model).name, host=args.host,
        port=args.port,
        tp=args.tp, pp=args.pp, replicas=args.replicas, redis_url=args.redis_url, redis_port=args.redis_port,
        redis_cluster=args.redis_cluster,
        ray_address=args.ray_address, executor=args.executor, scheduler_args=engine_argv(args),
        num_cpus_per_rank=args.num_cpus_per_rank, placement_strategy=args.placement_strategy,
        gateway_workers=args.gateway_workers or default_gateway_workers(),
        batch_ingesters=args.batch_ingesters, **_up_gateway_flags(args),
    )


def _up_gateway_flags(args: argparse.Namespace) -> dict:
    """The gateway's flags `up` passes on: batch_args (what every batch ingester takes too:
    the tenants), gateway_args, and gateway_env for the API keys (an environment variable, as
    `tokenfleet gateway` reads them, keeps them out of `ps`)."""
    if args.max_queue is not None and args.max_queue < 0:
        raise InvalidRequestError(f"--max-queue must be >= 0 (0: no limit), got {args.max_queue}",
                                  param="max-queue")
    batch_args = ["--tenants-file", os.path.abspath(args.tenants_file)] if args.tenants_file else []
    if args.tenants_from_redis:
        batch_args.append("--tenants-from-redis")
    gateway_args = ["--routing", args.routing]
    if args.public_metrics:
        gateway_args.append("--public-metrics")
    for root in _list_value(args, "lora-root"):
        gateway_args += ["--lora-root", os.path.abspath(root)]
    for name, value in (("max-queue", args.max_queue), ("max-n", args.max_n)):
        if value is not None:
            gateway_args += [f"--{name}", str(value)]
    api_keys = _list_value(args, "api-key")
    if any("," in key or not key for key in api_keys):
        raise InvalidRequestError("an --api-key must be non-empty and hold no comma", param="api-key")
    return {"batch_args": batch_args, "gateway_args": gateway_args,
            "gateway_env": {"TOKENFLEET_API_KEY": ",".join(api_keys)} if api_keys else {}}


def cmd_up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tokenfleet.up import Fleet, curl_example

    options = fleet_options(args)
    autoscale = options.autoscale
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet = Fleet(options)
    try:
        fleet.start()
        replicas_text = (f"{options.replicas} replica(s)" if autoscale is None else
                         f"{autoscale.policy.min_replicas}-{autoscale.policy.max_replicas} replicas, "
                         "autoscaled")
        print(f"tokenfleet is up: {fleet.gateway_url} serving {options.model_name!r} "
              f"({replicas_text}, TP={options.tp}{f', PP={options.pp}' if options.pp > 1 else ''}; "
              f"{options.gateway_workers} gateway "
              f"process(es); Redis {fleet.redis_url})")
        print("try:")
        print(curl_example(fleet.gateway_url, options.model_name))
        print(f"watch it: {fleet.gateway_url}/ (status page), {fleet.gateway_url}/metrics (Prometheus: "
              "the gateway's and every scheduler's), `tokenfleet status`", flush=True)
        return fleet.wait(stop.is_set)
    finally:
        fleet.stop()
