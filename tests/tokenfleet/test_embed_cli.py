"""`tokenfleet embed`: one JSON line per text, the in-process engine's vectors."""

from __future__ import annotations

import json

import numpy as np

from testkit.checkpoints import (
    add_tiny_wordpiece_tokenizer,
    make_tiny_bert,
    write_sentence_transformers_files,
)
from tokenfleet.cli import main


def test_embed_prints_a_json_line_per_text(tmp_path, capsys) -> None:
    folder = make_tiny_bert(tmp_path / "bert")
    add_tiny_wordpiece_tokenizer(folder)
    write_sentence_transformers_files(folder, "mean", matryoshka_dimensions=[16, 32])
    capsys.readouterr()
    assert main(["embed", "--model", str(folder), "--num-kv-blocks", "64", "--dimensions", "16",
                 "hello world", "the quick brown fox"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["num_prompt_tokens"] for line in lines] == [4, 6]  # [CLS] ... [SEP]
    for line in lines:
        assert len(line["embedding"]) == 16
        assert abs(np.linalg.norm(line["embedding"]) - 1) < 1e-5
