"""Every engine flag of the table (tokenfleet/engine_flags.py) given to `up` or `autoscale`
reaches the schedulers they start: the EngineConfig a scheduler builds from the command line
they give it is the one `tokenfleet scheduler` builds from the same flags."""

from __future__ import annotations

import dataclasses

import pytest

from shared.config import DEVICE_DEFAULTS, EngineConfig
from tokenfleet.cli import autoscale_argv_for, build_parser, fleet_options
from tokenfleet.engine_flags import ENGINE_FLAGS, engine_config
from tokenfleet.up import Fleet

# A value of each flag that differs from its default (None: a switch).
SAMPLES = {
    "runner": "pooling",
    "tp": "2", "pp": "2", "executor": "ray", "device": "cpu", "dtype": "bfloat16", "max-model-len": "512",
    "num-kv-blocks": "64", "block-size": "32", "quantization": "int8", "kv-cache-dtype": "fp8",
    "calculate-kv-scales": "off",
    "max-num-seqs": "8", "max-num-batched-tokens": "1024", "cuda-graph-max-batch-size": "4",
    "cuda-graph-max-tokens": "256",
    "num-threads": "2", "ray-address": "127.0.0.1:6380", "placement-strategy": "SPREAD",
    "num-cpus-per-rank": "0.5", "async-scheduling": "on", "no-prefix-caching": None,
    "grammar-jump-forward": None, "itl-target-ms": "12.5", "itl-slowdown": "2",
    "max-weight-bytes-per-rank": "24e9", "enable-lora": None, "lora-modules": "sql=/adapters/sql",
    "max-loras": "4", "max-lora-rank": "64", "max-cpu-loras": "8", "kv-offloading-size": "16",
    "speculative-config": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}',
}
PLACEMENT_GROUP = "tokenfleet-replica-m-0"  # the one flag the launchers set per replica


def _flags(model: str, *, placement_group: bool) -> list[str]:
    flags = ["--model", model]
    for name, value in SAMPLES.items():
        flags += [f"--{name}"] if value is None else [f"--{name}", value]
    return flags + (["--placement-group", PLACEMENT_GROUP] if placement_group else [])


def _scheduler_config(argv: list[str]) -> EngineConfig:
    """The config of a scheduler started with `argv` (python -m tokenfleet.cli scheduler ...)."""
    assert argv[1:4] == ["-m", "tokenfleet.cli", "scheduler"], argv
    return engine_config(build_parser().parse_args(argv[3:]))


@pytest.fixture
def wanted(tmp_path) -> EngineConfig:
    """`tokenfleet scheduler` given every sample: each field a flag sets is off its default."""
    config = engine_config(build_parser().parse_args(["scheduler", *_flags(str(tmp_path),
                                                                             placement_group=True)]))
    plain = EngineConfig.for_device("cpu", model=str(tmp_path))
    same = [spec.name for spec in ENGINE_FLAGS if spec.config_field not in (None, "model")
            and getattr(config, spec.config_field) == getattr(plain, spec.config_field)]
    assert not same, f"samples equal to the defaults: {same}"
    assert config.use_ray and not plain.use_ray  # (--executor ray)
    return config


def test_every_flag_of_the_table_has_a_sample() -> None:
    assert set(SAMPLES) | {"model", "placement-group"} == {spec.name for spec in ENGINE_FLAGS}


def test_every_engine_flag_given_to_up_reaches_its_schedulers(tmp_path, wanted) -> None:
    fleet = Fleet(fleet_options(build_parser().parse_args(["up", *_flags(str(tmp_path),
                                                                         placement_group=False)])))
    fleet.redis_url = "redis://127.0.0.1:1/0"  # (what starting its Redis would set)
    assert _scheduler_config(fleet.scheduler_argv("m-0", PLACEMENT_GROUP)) == wanted  # autoscaled
    argv, _ = fleet.scheduler_command(0)
    assert _scheduler_config(argv) == dataclasses.replace(wanted, placement_group_name=None)


def test_every_engine_flag_given_to_autoscale_reaches_its_schedulers(tmp_path, wanted) -> None:
    args = build_parser().parse_args(["autoscale", "--max-replicas", "2", *_flags(str(tmp_path),
                                                                                  placement_group=False),
                                      "--", "--lease-s", "3"])
    argv = autoscale_argv_for(args, str(tmp_path), "m")("m-0", PLACEMENT_GROUP)
    assert _scheduler_config(argv) == wanted
    assert argv[-4:] == ["--key-prefix", "tf:", "--lease-s", "3"]


def test_flags_left_out_reach_no_scheduler_and_take_the_devices_defaults(tmp_path) -> None:
    """`up` with no engine flag hands its schedulers none: each resolves the defaults of its own
    device, the same ones EngineConfig.for_device gives an in-process user."""
    fleet = Fleet(fleet_options(build_parser().parse_args(["up", "--model", str(tmp_path)])))
    fleet.redis_url = "redis://127.0.0.1:1/0"
    argv = fleet.scheduler_argv("m-0")
    assert argv[argv.index("--scheduler-id") + 2:] == ["--tp", "1", "--pp", "1", "--executor", "auto"]
    for device, defaults in DEVICE_DEFAULTS.items():
        config = EngineConfig.for_device(device, model="m")
        assert (config.max_num_seqs, config.max_num_batched_tokens, config.cuda_graph_max_batch_size) == \
            (defaults.max_num_seqs, defaults.max_num_batched_tokens, defaults.max_num_seqs)
    cpu = engine_config(build_parser().parse_args(["scheduler", "--model", "m", "--device", "cpu"]))
    assert cpu == EngineConfig.for_device("cpu", model="m", device="cpu")
    assert EngineConfig.for_device("cpu", model="m") == EngineConfig(model="m")  # the dataclass: the CPU's


def test_async_scheduling_takes_on_or_off_and_names_itself_otherwise(tmp_path, capsys) -> None:
    def parsed(*flags: str) -> EngineConfig:
        return engine_config(build_parser().parse_args(["scheduler", "--model", str(tmp_path), *flags]))

    assert parsed("--async-scheduling", "on").async_scheduling is True
    assert parsed("--async-scheduling", "off").async_scheduling is False
    assert parsed("--device", "cpu").async_scheduling is False  # the CPU's default
    with pytest.raises(SystemExit):
        parsed("--async-scheduling", "maybe")
    assert "--async-scheduling: expected on or off, got 'maybe'" in capsys.readouterr().err


def test_calculate_kv_scales_takes_auto_on_or_off_and_names_itself_otherwise(tmp_path, capsys) -> None:
    def parsed(*flags: str) -> EngineConfig:
        return engine_config(build_parser().parse_args(["scheduler", "--model", str(tmp_path), *flags]))

    assert parsed().calculate_kv_scales is None  # auto: measured where the checkpoint has none
    assert parsed("--calculate-kv-scales", "on").calculate_kv_scales is True
    assert parsed("--calculate-kv-scales", "off").calculate_kv_scales is False
    with pytest.raises(SystemExit):
        parsed("--calculate-kv-scales", "maybe")
    assert "--calculate-kv-scales: expected auto, on or off, got 'maybe'" in capsys.readouterr().err


def test_itl_target_takes_auto_off_or_milliseconds_and_the_slowdown_at_least_one(tmp_path, capsys) -> None:
    def parsed(*flags: str) -> EngineConfig:
        return engine_config(build_parser().parse_args(["scheduler", "--model", str(tmp_path), *flags]))

    assert parsed().itl_target_ms is None and parsed().itl_slowdown == 1.4  # auto
    assert parsed("--itl-target-ms", "auto").itl_target_ms is None
    assert parsed("--itl-target-ms", "off").itl_target_ms == 0.0
    assert parsed("--itl-target-ms", "15").itl_target_ms == 15.0
    assert parsed("--itl-slowdown", "1.2").itl_slowdown == 1.2
    for flag, value, words in (("--itl-target-ms", "soon", "expected auto, off or milliseconds"),
                               ("--itl-target-ms", "-3", "expected auto, off or milliseconds >= 0"),
                               ("--itl-slowdown", "0.5", "expected a number >= 1")):
        with pytest.raises(SystemExit):
            parsed(flag, value)
        assert f"{flag}: {words}" in capsys.readouterr().err


def test_max_weight_bytes_per_rank_takes_a_byte_count_and_names_itself_otherwise(tmp_path, capsys) -> None:
    def parsed(*flags: str) -> EngineConfig:
        return engine_config(build_parser().parse_args(["scheduler", "--model", str(tmp_path), *flags]))

    assert parsed("--max-weight-bytes-per-rank", "24e9").max_weight_bytes_per_rank == 24_000_000_000
    assert parsed().max_weight_bytes_per_rank is None
    for bad in ("lots", "-1"):
        with pytest.raises(SystemExit):
            parsed("--max-weight-bytes-per-rank", bad)
        assert "--max-weight-bytes-per-rank: expected" in capsys.readouterr().err


def test_speculative_config_takes_vllms_json_and_names_the_bad_key(tmp_path, capsys) -> None:
    def parsed(*flags: str) -> EngineConfig:
        return engine_config(build_parser().parse_args(["scheduler", "--model", str(tmp_path), *flags]))

    assert parsed().speculative_config is None
    assert parsed("--speculative-config", "off").speculative_config is None
    config = parsed("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}')
    config = config.speculative_config
    assert (config.method, config.num_speculative_tokens) == ("ngram", 5)
    for value, words in (('{"method": "ngram", "lookahead": 2}', "unknown key 'lookahead'"),
                         ('{"method": "draft_model"}', 'method "draft_model" needs "model"'),
                         ("{", "is not JSON")):
        with pytest.raises(SystemExit):
            parsed("--speculative-config", value)
        assert words in capsys.readouterr().err
