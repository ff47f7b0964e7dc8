"""Fixtures shared by the whole suite: tiny checkpoints and the default model."""

from __future__ import annotations

import os

# The suite runs two pytest workers on a 2-core machine, and most tests start processes of their
# own (schedulers, gateways, Ray ranks) that run beside the other worker's. Torch's default, one
# thread per core in every process, then oversubscribes the cores: a parallel region waits on a
# thread that another process holds off its core, and a CPU scheduler beside a busy process ran its
# steps about ten times slower (aiperf's 6 requests: 45 s against 3.6 s with one thread). One thread
# per process here and in every process a test starts (they inherit the environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from testkit.checkpoints import TINY_ARCHS, make_tiny_checkpoint, tiny_llama_with_smollm2_tokenizer  # noqa: E402
from tests.fleet_helpers import TINY_CHAT  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> folder of a tiny random-weight checkpoint, built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The default model folder (fetched once into $TOKENFLEET_HOME, ~20 s the first time)."""
    from workers.default_model import fetch_default_model

    return fetch_default_model()


@pytest.fixture(scope="session")
def tiny_chat(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (2 layers, hidden 64) that speaks SmolLM2's tokenizer, chat template
    and stop ids, with a 2,048-token window: the gateway's real text work applies while a step
    costs milliseconds, so fleet tests measure the fleet. Built once per session."""
    return tiny_llama_with_smollm2_tokenizer(tmp_path_factory.mktemp("models") / TINY_CHAT, smollm2,
                                             with_stop_ids=True, max_position_embeddings=2048)


@pytest.fixture
def redis_server(tmp_path: Path):
    """A fresh real Redis server per test (it starts in milliseconds)."""
    from tokenfleet.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen (v1) folder laid out as the published ones (testkit/qwen_checkpoints.py),
    logn attention and dynamic NTK on, seq_length 64. Built once per session."""
    from testkit.qwen_checkpoints import make_qwen_checkpoint

    return make_qwen_checkpoint(tmp_path_factory.mktemp("qwen") / "tiny-qwen")


@pytest.fixture(scope="session")
def tiny_qwen_as_qwen2(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen's weights as a transformers Qwen2ForCausalLM folder (the reference inside seq_length)."""
    from testkit.qwen_checkpoints import qwen_to_qwen2

    return qwen_to_qwen2(tiny_qwen, tmp_path_factory.mktemp("qwen2") / "tiny-qwen-as-qwen2")


# name -> (rank, target modules): three adapters on different projection sets, B not zero.
LORA_SPECS = {
    "rank4-qv": (4, ["q_proj", "v_proj"]),
    "rank8-ko-gate": (8, ["k_proj", "o_proj", "gate_proj"]),
    "rank16-all": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="session")
def lora_adapters(tiny_checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> folder of a random PEFT adapter (LORA_SPECS) of the tiny llama, built once."""
    from testkit.lora_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("lora")
    return {name: make_random_adapter(tiny_checkpoints["llama"], root / name, rank=rank,
                                      target_modules=targets, seed=seed)
            for seed, (name, (rank, targets)) in enumerate(LORA_SPECS.items())}
