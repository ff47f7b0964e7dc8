"""`tokenfleet generate` on bad input: one clear line naming the problem, non-zero exit,
no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", "generate", *args],
        capture_output=True, text=True, timeout=300,
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tokenfleet: error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-p", "0"], "top_p"),
        (["--temperature", "-1"], "temperature"),
    ],
)
def test_bad_sampling_flag_is_named(flags: list[str], needle: str, tiny_checkpoints) -> None:
    _assert_one_line_error(_generate("--model", str(tiny_checkpoints["llama"]), *flags, "hi"), needle)


def test_missing_model_folder_is_named(tmp_path) -> None:
    _assert_one_line_error(_generate("--model", str(tmp_path / "nope"), "hi"), "does not exist")


def test_corrupt_safetensors_is_named(tiny_checkpoints, tmp_path) -> None:
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _assert_one_line_error(_generate("--model", str(folder), "hi"), "model.safetensors")


def test_checkpoint_missing_a_tensor_is_named(tiny_checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    _assert_one_line_error(_generate("--model", str(folder), "hi"), "gate_up_proj", "lacks")


@pytest.mark.slow
def test_empty_prompt_is_named(smollm2) -> None:
    _assert_one_line_error(_generate("--model", str(smollm2), ""), "prompt is empty")


@pytest.mark.slow
def test_prompt_longer_than_context_window_is_named(smollm2) -> None:
    long_prompt = "word " * 9000  # SmolLM2's window is 8192 tokens
    _assert_one_line_error(_generate("--model", str(smollm2), long_prompt), "max_model_len=8192")


@pytest.mark.slow
def test_generate_json_prints_one_object_per_prompt(smollm2) -> None:
    proc = _generate("--model", str(smollm2), "--json", "--chat", "--max-tokens", "8",
                     "What is the capital of France?", "Say hi.")
    assert proc.returncode == 0, proc.stderr
    objects = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(objects) == 2
    for obj in objects:
        assert set(obj) == {"text", "token_ids", "finish_reason", "usage"}
        assert obj["usage"]["completion_tokens"] == len(obj["token_ids"]) <= 8
        assert obj["finish_reason"] in ("stop", "length")
