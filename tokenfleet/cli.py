"""The `tokenfleet` command. Each subcommand imports its package lazily, so that
`tokenfleet --help` is instant and a command never pays for parts it does not use.

Every flag can also come from a TOKENFLEET_<FLAG> environment variable
(e.g. --max-tokens from TOKENFLEET_MAX_TOKENS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from shared.config import DEFAULT_REDIS_URL, env_default
from shared.errors import InvalidRequestError, TokenfleetError
from tokenfleet.embed_cli import add_embed_parser, cmd_embed
from tokenfleet.engine_flags import (
    add_engine_flags,
    engine_config,
    resolve_model,
)
from tokenfleet.flags import REDIS_URL_HELP, ROUTING_MODES  # noqa: F401
from tokenfleet.flags import flag as _flag
from tokenfleet.flags import flag_table as _flag_table
from tokenfleet.flags import list_flag as _list_flag
from tokenfleet.flags import list_value as _list_value
from tokenfleet.flags import redis_flags as _redis_flags
from tokenfleet.fleet_cli import (
    add_autoscale_parser,
    add_up_parser,
    autoscale_argv_for,  # noqa: F401 - the tests build a replica's argv with it
    cmd_autoscale,
    cmd_up,
    fleet_options,  # noqa: F401 - the tests read up's options with it
)

# The scheduler's service settings (service/inflight.py ServiceSettings): name, type, default, help.
SERVICE_FLAGS = (
    ("lease-s", float, 10.0, "entries nobody renewed for this long are taken over"),
    ("max-deliveries", int, 3, "deliveries before an entry is dead-lettered"),
    ("result-ttl-s", int, 24 * 3600, "how long tf:res:{id} records live"),
    ("key-prefix", str, "tf:", "prefix of every Redis key"),
    ("heartbeat-s", float, 1.0,
     "heartbeat (load, KV use, engine metrics to Redis) and claim renewal, this often"),
    ("log-stats-interval-s", float, 5.0,
     "log prompt/generation tok/s, running, waiting and KV use this often while busy (0: never)"),
    ("steal-after-s", float, 2.0,
     "when idle, take requests routed to a busy peer that waited unread this long"),
    ("publisher-processes", int, 2,
     "processes that detokenize and write the results to Redis (each request in one of them)"),
)


def _resolve_redis_flags(args: argparse.Namespace) -> None:
    """The password file's password goes into --redis-url, once, for everything after."""
    from shared.redis_url import resolve_redis_url

    password_file = getattr(args, "redis_password_file", None)
    if args.command == "up":
        # `up` hands its children the URL on their command line: the password travels as the file's
        # path in their environment instead, never in argv.
        if password_file:
            os.environ["TOKENFLEET_REDIS_PASSWORD_FILE"] = os.path.abspath(password_file)
        if args.redis_url:
            resolve_redis_url(args.redis_url, password_file)  # checked here, used by the children
        return
    if args.command in ("batch", "status", "tenants") and not args.redis_url:
        from tokenfleet.up import recorded_redis_url

        args.redis_url = recorded_redis_url()  # the running fleet's, which may need the password
    if getattr(args, "redis_url", None):
        args.redis_url = resolve_redis_url(args.redis_url, password_file)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfleet", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="model folders")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    model_commands.add_parser("fetch", help="build the default model folder; print its path last")

    gen = commands.add_parser("generate", help="offline generation in-process (no Redis)")
    add_engine_flags(gen)
    _flag(gen, "replicas", type=int, default=1, help="engines side by side (data parallel)")
    _flag(gen, "chat", action="store_true", help="wrap each prompt in the model's chat template")
    _flag(gen, "max-tokens", type=int, default=256, help="tokens to generate per prompt")
    _flag(gen, "temperature", type=float, default=0.0, help="0 is greedy")
    _flag(gen, "top-p", type=float, default=1.0)
    _flag(gen, "top-k", type=int)
    _flag(gen, "min-p", type=float, default=0.0)
    _flag(gen, "seed", type=int)
    _flag(gen, "ignore-eos", action="store_true")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _flag(gen, "json", action="store_true", help="one JSON object per prompt")
    _flag(gen, "lora-name", help="run every prompt with this adapter of --lora-modules (needs --enable-lora)")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_embed_parser(commands)
    sched = commands.add_parser("scheduler", help="one scheduler and its worker group, fed from Redis")
    add_engine_flags(sched)
    _redis_flags(sched, default=DEFAULT_REDIS_URL)
    _flag(sched, "model-name", help="served model name (default: the model folder's name)")
    _flag(sched, "scheduler-id", help="unique id of this scheduler (default: hostname-pid-random)")
    _flag_table(sched, SERVICE_FLAGS)
    _add_gateway_parser(commands)
    add_up_parser(commands)
    _add_batch_parser(commands)
    _add_bench_parser(commands)
    _add_status_parser(commands)
    _add_tenants_parser(commands)
    add_autoscale_parser(commands)
    return parser


def _add_status_parser(commands) -> None:
    status = commands.add_parser("status", help="the fleet at a glance, from Redis: schedulers, queues, "
                                                "dead letters, batch jobs, gateways")
    _redis_flags(status, help="Redis (default: the fleet's from $TOKENFLEET_HOME/fleet.json)")
    _flag(status, "key-prefix", default="tf:", help="prefix of every Redis key")
    _flag(status, "json", action="store_true", help="one JSON object (the status page's /fleet.json)")


def _cmd_status(args: argparse.Namespace) -> int:
    from tokenfleet.status_cli import run_status_command

    return run_status_command(args)


def _add_batch_parser(commands) -> None:
    batch = commands.add_parser("batch", help="batch jobs: submit, status, cancel, results; the ingester")
    actions = batch.add_subparsers(dest="batch_command", required=True)
    submit = actions.add_parser("submit",
                                help="submit a JSONL file (OpenAI Batch input lines); print the job id")
    submit.add_argument("file", metavar="FILE.jsonl")
    _flag(submit, "model", help="the job's model (default: the lines' body.model)")
    _flag(submit, "endpoint", help="every line's url must be this (/v1/chat/completions or /v1/completions)")
    _flag(submit, "job-id", help="the job's id (default: batch_<random>)")
    _flag(submit, "completion-window", default="24h", help="the job expires after this (24h, 90m, 3600s)")
    _flag(submit, "metadata", help="a JSON object kept with the job")
    _flag(submit, "wait", action="store_true", help="follow the job with a progress bar until it ends")
    _flag(submit, "output", help="with --wait: write the result lines to this file")
    for name, text in (("status", "the job as a JSON object (OpenAI's Batch)"),
                       ("cancel", "cancel the job: queued lines are cancelled, the rest written off"),
                       ("results", "the job's output lines (JSONL), as far as written")):
        action = actions.add_parser(name, help=text)
        action.add_argument("job", metavar="JOB")
        if name == "results":
            _flag(action, "output", help="write them to this file instead of stdout")
    ingester = actions.add_parser("ingester", help="a batch ingester alone (the gateway runs one too)")
    _list_flag(ingester, "model",
               help="model folder whose jobs it takes (repeatable; default: the default model)")
    _list_flag(ingester, "model-name", help="served name of the --model at the same position "
                                            "(default: its folder's name; as the gateway's)")
    _flag(ingester, "max-inflight", type=int, default=1024, help="per job: queued lines not yet written")
    _flag(ingester, "lease-s", type=float, default=10.0,
          help="work a dead ingester left is taken over after this")
    _flag(ingester, "tenants-file", help="tenants whose max_batch_lines_in_flight it keeps")
    _flag(ingester, "tenants-from-redis", action="store_true", help="also read tenants kept in Redis")
    for action in (submit, ingester, *(actions.choices[n] for n in ("status", "cancel", "results"))):
        _redis_flags(action, help="Redis (default: the fleet's from $TOKENFLEET_HOME/fleet.json)")
        _flag(action, "key-prefix", default="tf:", help="prefix of every Redis key")


def _add_tenants_parser(commands) -> None:
    tenants = commands.add_parser("tenants", help="tenants kept in Redis: API keys and limits "
                                                  "(for gateways run with --tenants-from-redis)")
    actions = tenants.add_subparsers(dest="tenants_command", required=True)
    set_ = actions.add_parser("set", help="create or change a tenant: add keys, set limits (0: no limit)")
    _list_flag(set_, "key", help="an API key of the tenant (repeatable)")
    for name in ("requests-per-minute", "tokens-per-minute", "max-concurrent-requests",
                 "max-batch-lines-in-flight"):
        set_.add_argument(f"--{name}", type=int)
    show = actions.add_parser("show", help="a tenant's limits, number of keys and requests in flight")
    remove = actions.add_parser("remove", help="remove a tenant and all its keys")
    for action in (set_, show, remove):
        action.add_argument("tenant", metavar="TENANT")
        _redis_flags(action, help="Redis (default: the fleet's from $TOKENFLEET_HOME/fleet.json, else "
                                  f"{DEFAULT_REDIS_URL})")
        _flag(action, "key-prefix", default="tf:", help="prefix of every Redis key")


def _cmd_tenants(args: argparse.Namespace) -> int:
    from tokenfleet.tenants_cli import run_tenants_command

    return run_tenants_command(args)


def _cmd_batch(args: argparse.Namespace) -> int:
    from tokenfleet.batch_cli import run_batch_command, run_ingester

    if args.batch_command == "ingester":
        return run_ingester(ingester_settings(args))
    return run_batch_command(args)


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench",
                                help="load generator against a running gateway: TTFT, ITL, throughput")
    _flag(bench, "url", help="the gateway (default: the fleet's from $TOKENFLEET_HOME/fleet.json, else "
                             "http://127.0.0.1:8000)")
    _flag(bench, "model", help="served model name (default: the first of /v1/models)")
    _flag(bench, "num-requests", type=int, default=100)
    _flag(bench, "duration", type=float, default=0.0,
          help="with --rate: send what arrives in this many seconds instead of --num-requests")
    _flag(bench, "concurrency", type=int, default=16, help="requests in flight at most")
    _flag(bench, "client-processes", type=int, default=1,
          help="deal the requests over this many client processes (a loaded client adds latency)")
    _flag(bench, "rate", type=float, default=0.0, help="new requests per second, Poisson (0: no pacing)")
    _flag(bench, "prefix-tokens", type=int, default=0,
          help="a system prompt of about this many tokens, shared by every request (0: none)")
    _flag(bench, "prompt-words", default="64",
          help="words of each user turn: N, A-B (uniform) or A-B:lognormal:MEAN")
    _flag(bench, "max-tokens", default="64",
          help="output tokens per request (EOS ignored): N, A-B or A-B:lognormal:MEAN")
    _flag(bench, "slo-ttft-ms", type=float, help="goodput: a request's TTFT within this")
    _flag(bench, "slo-itl-ms", type=float, help="goodput: a request's mean gap between tokens within this")
    _flag(bench, "temperature", type=float, default=0.0)
    _flag(bench, "json-share", type=float, default=0.0,
          help="this fraction of the chats ask for a json_schema answer (one long string; 0: none)")
    _flag(bench, "completions", action="store_true", help="/v1/completions instead of chat")
    _flag(bench, "api-key", help="Bearer key, when the gateway has --api-key")
    _flag(bench, "seed", type=int, default=0, help="seeds the prompts and the arrivals")
    _flag(bench, "timeout-s", type=float, default=300.0, help="a stream silent this long fails")
    _flag(bench, "json", action="store_true", help="one JSON object instead of the table")
    from tokenfleet.bench_multiturn import add_multi_turn_flags

    add_multi_turn_flags(bench, _flag)


def _cmd_bench(args: argparse.Namespace) -> int:
    from shared.errors import InvalidRequestError
    from tokenfleet.bench import LengthSpec, run_bench_command
    from tokenfleet.up import recorded_fleet

    for name in ("num_requests", "concurrency"):
        if getattr(args, name) < 1:
            flag = name.replace("_", "-")
            raise InvalidRequestError(f"--{flag} must be >= 1, got {getattr(args, name)}", param=flag)
    for name in ("prompt_words", "max_tokens"):
        try:
            LengthSpec.parse(getattr(args, name), name.replace("_", "-"))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=name.replace("_", "-")) from None
    if args.rate < 0 or args.timeout_s <= 0:
        raise InvalidRequestError("--rate must be >= 0 and --timeout-s > 0", param="rate")
    if args.duration < 0 or (args.duration and not args.rate) or args.prefix_tokens < 0:
        raise InvalidRequestError("--duration needs --rate (and >= 0); --prefix-tokens must be >= 0",
                                  param="duration")
    if not 0.0 <= args.json_share <= 1.0 or (args.json_share and args.completions):
        raise InvalidRequestError("--json-share must be in [0, 1], and chats only (not --completions)",
                                  param="json-share")
    if args.multi_turn:
        from tokenfleet.bench_multiturn import check_multi_turn_args

        check_multi_turn_args(args)
    args.url = (args.url or recorded_fleet().get("gateway_url") or "http://127.0.0.1:8000").rstrip("/")
    try:
        if args.multi_turn:
            from tokenfleet.bench_multiturn import run_multi_turn_command

            return run_multi_turn_command(args)
        return run_bench_command(args)
    except (OSError, RuntimeError) as exc:  # aiohttp's connection errors are OSErrors
        raise TokenfleetError(f"cannot benchmark {args.url}: {exc}") from None


def _add_gateway_parser(commands) -> None:
    gw = commands.add_parser("gateway", help="the OpenAI-compatible HTTP gateway in front of the schedulers")
    _redis_flags(gw, default=DEFAULT_REDIS_URL)
    _flag(gw, "host", default="127.0.0.1", help="address to listen on")
    _flag(gw, "port", type=int, default=8000)
    _list_flag(gw, "model", help="model folder it fronts: tokenizer, chat template (repeatable; "
                                 "default: the default model)")
    _list_flag(gw, "model-name", help="served name of the --model at the same position "
                                      "(default: its folder's name)")
    _list_flag(gw, "api-key", help="accepted Bearer key (repeatable; none: the gateway is open)")
    _flag(gw, "tenants-from-redis", action="store_true",
          help="also look API keys and tenant limits up in Redis (`tokenfleet tenants set`)")
    _flag(gw, "public-metrics", action="store_true",
          help="serve /metrics and /fleet.json to anyone even with --api-key or tenants (they name hosts, "
               "pids, jobs and errors; by default they need a key, an admin tenant's with tenants)")
    _list_flag(gw, "lora-root", help="a folder a tenant's POST /v1/load_lora_adapter may read adapters from "
                                     "(repeatable; none: only callers with no tenant, or admins, load "
                                     "adapters at runtime)")
    _flag(gw, "tenants-file", help="JSON file of tenants: their API keys and limits (requests and tokens per "
                                   "minute, concurrent requests, batch lines in flight); see the README")
    _flag(gw, "max-queue", type=int, default=1024, help="waiting requests per model before 429 (0: no limit)")
    _flag(gw, "max-n", type=int, default=8, help="cap on n (choices per request)")
    _flag(gw, "max-body-bytes", type=int, default=4 << 20, help="largest request body accepted")
    _flag(gw, "key-prefix", default="tf:", help="prefix of every Redis key")
    _flag(gw, "routing", default="prefix", choices=ROUTING_MODES,
          help="prefix: a chat goes to the replica whose KV cache holds its prefix, weighed against load "
               "(with more than one replica of a model); none: every replica pulls from one shared queue")
    _flag(gw, "no-batch-ingester", action="store_true",
          help="run no batch ingester in this process (run `tokenfleet batch ingester` elsewhere)")
    _flag(gw, "batch-max-inflight", type=int, default=1024,
          help="per batch job: queued lines not yet written")
    _flag(gw, "batch-lease-s", type=float, default=10.0,
          help="batch work a dead ingester left is taken over after this")
    _flag(gw, "workers", type=int, default=1,
          help="gateway processes on this one port (SO_REUSEPORT), each a whole gateway with its own Redis "
               "connections and batch ingester, started and restarted by this process; with more than one, "
               "/metrics (from whichever answers) sums them all (prometheus_client multiprocess mode)")


def _cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.http.server import serve

    settings = gateway_settings(args)
    if args.workers > 1:
        from gateway.http.supervisor import run_workers

        return run_workers(settings, args.workers)
    serve(settings)
    return 0


def _batch_settings(args: argparse.Namespace) -> dict:
    """What every batch ingester takes from its flags, the gateway's own and `tokenfleet batch
    ingester`'s alike: the models (folders and served names), the key prefix and the tenants
    (whose max_batch_lines_in_flight it keeps). GatewaySettings' fields."""
    from gateway.core.settings import ModelSpec
    from gateway.tenants.directory import TenantDirectory

    paths = _list_value(args, "model") or [resolve_model(None)]
    names = _list_value(args, "model-name")
    if len(names) > len(paths):
        raise InvalidRequestError(f"{len(names)} --model-name for {len(paths)} --model", param="model-name")
    return {"models": [ModelSpec.from_path(path, names[i] if i < len(names) else None)
                       for i, path in enumerate(paths)],
            "key_prefix": args.key_prefix,
            "tenants": (TenantDirectory.from_file(args.tenants_file) if args.tenants_file
                        else TenantDirectory.empty()),
            "tenants_from_redis": args.tenants_from_redis}


def ingester_settings(args: argparse.Namespace):
    """`tokenfleet batch ingester`'s flags -> the GatewaySettings its BatchIngester runs with."""
    from gateway.core.settings import GatewaySettings
    from tokenfleet.up import recorded_redis_url

    return GatewaySettings(redis_url=args.redis_url or recorded_redis_url(),
                           batch_max_inflight=args.max_inflight, batch_lease_s=args.lease_s,
                           **_batch_settings(args))


def gateway_settings(args: argparse.Namespace):
    """`tokenfleet gateway`'s flags -> its GatewaySettings (InvalidRequestError naming a bad flag)."""
    from gateway.core.settings import GatewaySettings

    for name, value in (("port", args.port), ("max-n", args.max_n), ("max-body-bytes", args.max_body_bytes),
                        ("workers", args.workers)):
        if value < 1:
            raise InvalidRequestError(f"--{name} must be >= 1, got {value}", param=name)
    if args.max_queue < 0:
        raise InvalidRequestError(f"--max-queue must be >= 0 (0: no limit), got {args.max_queue}",
                                  param="max-queue")
    if args.routing not in ROUTING_MODES:  # (a TOKENFLEET_ROUTING value skips argparse's check)
        raise InvalidRequestError(f"--routing must be prefix or none, got {args.routing!r}", param="routing")
    return GatewaySettings(
        redis_url=args.redis_url, host=args.host, port=args.port,
        api_keys=tuple(_list_value(args, "api-key")), max_queue=args.max_queue,
        max_n=args.max_n, max_body_bytes=args.max_body_bytes, batch_ingester=not args.no_batch_ingester,
        batch_max_inflight=args.batch_max_inflight, batch_lease_s=args.batch_lease_s, routing=args.routing,
        public_metrics=args.public_metrics,
        lora_roots=tuple(os.path.realpath(root) for root in _list_value(args, "lora-root")),
        **_batch_settings(args),
    )


def _cmd_scheduler(args: argparse.Namespace) -> int:
    import signal
    import socket
    import threading
    import uuid
    from pathlib import Path

    from protocol.keys import keys_for
    from scheduler.engine import LLMEngine
    from service.scheduler_service import SchedulerService, ServiceSettings
    from shared.errors import InvalidRequestError
    from shared.gc_tuning import tune_for_serving
    from workers.device import resolve_device

    if args.heartbeat_s <= 0:
        raise InvalidRequestError(f"--heartbeat-s must be > 0, got {args.heartbeat_s}", param="heartbeat-s")
    if args.publisher_processes < 1:
        raise InvalidRequestError(f"--publisher-processes must be >= 1, got {args.publisher_processes}",
                                  param="publisher-processes")
    config = engine_config(args)
    settings = ServiceSettings(
        model_name=args.model_name or Path(config.model).name,
        scheduler_id=args.scheduler_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        lease_s=args.lease_s, max_deliveries=args.max_deliveries, result_ttl_s=args.result_ttl_s,
        heartbeat_s=args.heartbeat_s, log_stats_interval_s=args.log_stats_interval_s,
        steal_after_s=args.steal_after_s, num_publishers=args.publisher_processes,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with LLMEngine(config) as engine:
        if resolve_device(config.device).type == "cuda":
            engine.warm_up()  # kernels compile before the first request, not during it
        keys = keys_for(args.redis_url, args.key_prefix)
        service = SchedulerService(engine, args.redis_url, settings, keys)
        tune_for_serving()  # startup done: its heap leaves the collector's walks (shared/gc_tuning.py)
        service.run(stop)
    return 0


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    from workers.default_model import fetch_default_model

    print(fetch_default_model())
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import transformers

    from scheduler.engine import LLMEngine
    from shared.sampling import SamplingParams

    # Our own errors say what is wrong; transformers' warnings (e.g. on long prompts) only add noise.
    transformers.logging.set_verbosity_error()

    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos,
    ).validate()
    config = engine_config(args)
    if args.replicas > 1:
        from scheduler.replicas import ReplicatedEngine

        engine_cm = ReplicatedEngine(config, args.replicas)
    else:
        engine_cm = LLMEngine(config)
    with engine_cm as engine:
        lora_names = [args.lora_name] * len(args.prompts) if args.lora_name else None
        results = engine.generate(args.prompts, sampling, chat=args.chat, lora_names=lora_names)
    for result in results:
        if args.json:
            print(json.dumps(result.to_json_dict(), ensure_ascii=False))
        else:
            print(result.text)
    return 0


COMMANDS = {"generate": _cmd_generate, "embed": cmd_embed, "model": _cmd_model_fetch,
            "scheduler": _cmd_scheduler,
            "gateway": _cmd_gateway, "up": cmd_up, "batch": _cmd_batch,
            "bench": _cmd_bench, "status": _cmd_status, "tenants": _cmd_tenants, "autoscale": cmd_autoscale}


def _redis_credentials_problem(exc: Exception) -> str | None:
    """One line for Redis refusing (or wanting) a password; None for anything else."""
    if not type(exc).__module__.startswith("redis"):
        return None  # (redis is imported only by commands that use it)
    from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, ResponseError

    if isinstance(exc, (AuthenticationError, AuthenticationWrongNumberOfArgsError)):
        return f"Redis refused the credentials ({exc}); check --redis-url and --redis-password-file"
    if isinstance(exc, ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS")):
        return f"Redis wants a password ({exc}); give it in --redis-url or --redis-password-file"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from shared.logging import configure_logging

    level = env_default("log_level", "WARNING")
    os.environ["TOKENFLEET_LOG_LEVEL"] = level  # worker processes inherit it
    configure_logging(level)
    try:
        _resolve_redis_flags(args)
        return COMMANDS[args.command](args)
    except TokenfleetError as exc:
        # A user error: one line naming the problem, no traceback.
        print(f"tokenfleet: error: {exc.message}", file=sys.stderr)
        return 1
    except Exception as exc:
        message = _redis_credentials_problem(exc)
        if message is None:
            raise
        print(f"tokenfleet: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
