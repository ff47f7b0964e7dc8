"""How a model folder pools (shared/pooling_config.py): sentence-transformers' files, the
defaults without them, Matryoshka sizes, and the refusals by name."""

from __future__ import annotations

import json

import pytest

from shared.errors import ModelLoadError
from shared.pooling_config import PoolingType, read_pooling_config
from shared.pooling_params import finish_embedding


def _folder(tmp_path, model_type: str = "llama", **config) -> object:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64, **config}))
    return tmp_path


def _sentence_transformers(folder, modules: list[str], **pooling) -> None:
    entries = [
        {
            "idx": i,
            "name": str(i),
            "path": "1_Pooling" if m == "Pooling" else "",
            "type": f"sentence_transformers.models.{m}",
        }
        for i, m in enumerate(modules)
    ]
    (folder / "modules.json").write_text(json.dumps(entries))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))


def test_defaults_are_vllms_last_token_for_decoders_and_cls_for_bert(tmp_path):
    (tmp_path / "d").mkdir()
    decoder = read_pooling_config(_folder(tmp_path / "d"))
    assert (decoder.pooling_type, decoder.normalize, decoder.source) == (PoolingType.LAST, True, "default")
    (tmp_path / "b").mkdir()
    bert = read_pooling_config(_folder(tmp_path / "b", "bert"))
    assert (bert.pooling_type, bert.normalize) == (PoolingType.CLS, True)


@pytest.mark.parametrize(
    "flag, kind",
    [
        ("pooling_mode_cls_token", PoolingType.CLS),
        ("pooling_mode_mean_tokens", PoolingType.MEAN),
        ("pooling_mode_lasttoken", PoolingType.LAST),
    ],
)
def test_sentence_transformers_pooling_and_normalize(tmp_path, flag, kind):
    folder = _folder(tmp_path)
    _sentence_transformers(folder, ["Transformer", "Pooling"], **{flag: True})
    config = read_pooling_config(folder)
    assert (config.pooling_type, config.normalize, config.source) == (kind, False, "sentence-transformers")


@pytest.mark.parametrize(
    "modules, pooling, words",
    [
        (["Transformer", "Pooling", "Dense"], {"pooling_mode_mean_tokens": True}, "Dense"),
        (["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
        (
            ["Transformer", "Pooling"],
            {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
            "exactly one",
        ),
        (
            ["Transformer", "Pooling"],
            {"pooling_mode_mean_tokens": True, "include_prompt": False},
            "include_prompt",
        ),
        (["Transformer"], {}, "no Pooling module"),
    ],
)
def test_what_we_cannot_run_exactly_is_refused_by_name(tmp_path, modules, pooling, words):
    folder = _folder(tmp_path)
    _sentence_transformers(folder, modules, **pooling)
    with pytest.raises(ModelLoadError, match=words):
        read_pooling_config(folder)


def test_matryoshka_sizes_decide_which_dimensions_pass(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    listed = read_pooling_config(_folder(tmp_path / "a", matryoshka_dimensions=[32, 16]))
    assert listed.matryoshka_dimensions == (16, 32)
    assert listed.check_dimensions(16) is None and listed.check_dimensions(None) is None
    assert "not one this model declares" in listed.check_dimensions(20)
    assert "between 1 and 64" in listed.check_dimensions(65)
    free = read_pooling_config(_folder(tmp_path / "b", is_matryoshka=True))
    assert free.check_dimensions(20) is None
    assert "Matryoshka" in read_pooling_config(_folder(tmp_path / "c")).check_dimensions(16)


def test_a_cut_is_renormalized_only_when_the_model_normalizes():
    import numpy as np

    vector = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    raw = vector.tobytes()
    assert finish_embedding(raw, None, True) == raw
    np.testing.assert_allclose(np.frombuffer(finish_embedding(raw, 2, True), np.float32), [0.6, 0.8])
    np.testing.assert_allclose(np.frombuffer(finish_embedding(raw, 2, False), np.float32), [3.0, 4.0])
