"""Embeddings of the pooling runner (`--runner pooling`) judged against transformers in float32.

Every family we serve for embeddings (llama, qwen2, qwen3 decoders, a BERT encoder), every
pooling (CLS, mean, last token; normalized or not) as sentence-transformers declares it, the
defaults without its files, Matryoshka `dimensions`, inputs cut into chunks by a small step
budget, and the runner refusals. The reference is transformers' `AutoModel` hidden states with
the pooling done by hand (and, where it applies, by the sentence-transformers package itself).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.errors import InvalidRequestError, ModelLoadError
from testkit.checkpoints import (
    make_tiny_bert,
    make_tiny_checkpoint,
    make_tiny_decoder_body,
    write_sentence_transformers_files,
)

MIN_COSINE = 0.9999
PROMPT_LENGTHS = (1, 5, 17, 40, 33)  # with a 16-token budget the longer ones arrive in chunks


def _prompts(seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _reference(folder: Path, prompts: list[list[int]], pooling: str, normalize: bool) -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for ids in prompts:  # one at a time: no padding to get wrong
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # after the final norm
            vector = {"cls": hidden[0], "mean": hidden.mean(0), "last": hidden[-1]}[pooling]
            vectors.append((F.normalize(vector, dim=-1) if normalize else vector).numpy())
    return vectors


def _engine(folder: Path, **fields) -> LLMEngine:
    fields = {"num_kv_blocks": 64, "max_num_batched_tokens": 16, "max_num_seqs": 8, **fields}
    return LLMEngine(EngineConfig(model=str(folder), runner="pooling", **fields), load_tokenizer_files=False)


def _assert_close(ours: list[np.ndarray], expected: list[np.ndarray], *, same_norm: bool = False) -> None:
    assert len(ours) == len(expected)
    for index, (a, b) in enumerate(zip(ours, expected, strict=True)):
        assert a.shape == b.shape, index
        cosine = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        assert cosine >= MIN_COSINE, f"prompt {index}: cosine {cosine}"
        if same_norm:
            assert np.linalg.norm(a) == pytest.approx(np.linalg.norm(b), rel=1e-4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    return {
        "llama": make_tiny_checkpoint("llama", root / "llama"),
        "qwen2": make_tiny_checkpoint("qwen2", root / "qwen2"),
        "qwen3_body": make_tiny_decoder_body("qwen3", root / "qwen3_body"),  # Qwen3-Embedding's layout
        "bert": make_tiny_bert(root / "bert"),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_body"])
def test_decoder_default_is_the_last_token_normalized(folders, family):
    prompts = _prompts()
    with _engine(folders[family]) as engine:
        results = engine.embed(prompts)
    assert [r.num_prompt_tokens for r in results] == list(PROMPT_LENGTHS)
    _assert_close([r.embedding for r in results], _reference(folders[family], prompts, "last", True))
    assert all(np.linalg.norm(r.embedding) == pytest.approx(1.0, abs=1e-5) for r in results)


def test_bert_default_is_cls_normalized(folders):
    prompts = _prompts(1)
    with _engine(folders["bert"]) as engine:
        results = engine.embed(prompts)
    _assert_close([r.embedding for r in results], _reference(folders["bert"], prompts, "cls", True))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_body", "bert"])
@pytest.mark.parametrize("pooling", ["cls", "mean", "lasttoken"])
def test_sentence_transformers_pooling(folders, tmp_path, family, pooling):
    """Each pooling sentence-transformers declares, with its Normalize module or without it
    (then the vectors keep their length), inputs longer than the step budget included."""
    import shutil

    normalize = pooling != "mean"  # one unnormalized case per family
    folder = Path(shutil.copytree(folders[family], tmp_path / family))
    write_sentence_transformers_files(folder, pooling, normalize=normalize)
    prompts = _prompts(2)
    with _engine(folder) as engine:
        results = engine.embed(prompts)
    expected = _reference(folder, prompts, {"lasttoken": "last"}.get(pooling, pooling), normalize)
    _assert_close([r.embedding for r in results], expected, same_norm=True)


def test_bert_matches_the_sentence_transformers_package(folders, tmp_path):
    """The whole sentence-transformers pipeline (Transformer, mean Pooling, Normalize) on the
    same folder, fed the same token ids."""
    import shutil

    st = pytest.importorskip("sentence_transformers")
    folder = Path(shutil.copytree(folders["bert"], tmp_path / "bert"))
    write_sentence_transformers_files(folder, "mean", normalize=True)
    prompts = _prompts(3)
    reference_model = st.SentenceTransformer(str(folder), device="cpu")
    expected = []
    with torch.no_grad():
        for ids in prompts:
            features = {
                "input_ids": torch.tensor([ids]),
                "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                "token_type_ids": torch.zeros(1, len(ids), dtype=torch.long),
            }
            expected.append(reference_model(features)["sentence_embedding"][0].numpy())
    with _engine(folder) as engine:
        results = engine.embed(prompts)
    _assert_close([r.embedding for r in results], expected, same_norm=True)


def test_one_step_holds_many_inputs(folders):
    """With room for them all, every input runs in one forward and comes out right."""
    prompts = _prompts(4)
    with _engine(folders["llama"], max_num_batched_tokens=512) as engine:
        results = engine.embed(prompts)
        assert engine.num_steps == 1
    _assert_close([r.embedding for r in results], _reference(folders["llama"], prompts, "last", True))


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_matryoshka_dimensions_cut_then_renormalize(folders, tmp_path, family):
    import shutil

    folder = Path(shutil.copytree(folders[family], tmp_path / family))
    write_sentence_transformers_files(folder, "mean", normalize=True, matryoshka_dimensions=[16, 32, 64])
    prompts = _prompts(5)
    full = _reference(folder, prompts, "mean", False)
    expected = [v[:32] / np.linalg.norm(v[:32]) for v in full]
    with _engine(folder) as engine:
        results = engine.embed(prompts, dimensions=32)
        assert all(r.embedding.shape == (32,) for r in results)
        _assert_close([r.embedding for r in results], expected)
        with pytest.raises(InvalidRequestError, match="dimensions` 20 is not one this model declares") as exc:
            engine.embed(prompts[:1], dimensions=20)
        assert exc.value.param == "dimensions"


def test_dimensions_without_matryoshka_sizes_is_refused(folders):
    with _engine(folders["llama"]) as engine, pytest.raises(InvalidRequestError, match="Matryoshka") as exc:
        engine.embed([[5, 6, 7]], dimensions=16)
    assert exc.value.param == "dimensions"


def test_truncate_prompt_tokens_keeps_the_last_tokens(folders):
    prompt = _prompts(6)[3]  # 40 tokens
    with _engine(folders["llama"]) as engine:
        [cut] = engine.embed([prompt], truncate_prompt_tokens=10)
        [whole] = engine.embed([prompt[-10:]])
    assert cut.num_prompt_tokens == 10
    np.testing.assert_allclose(cut.embedding, whole.embedding, rtol=1e-5, atol=1e-6)


def test_an_input_longer_than_the_model_is_refused(folders):
    with _engine(folders["bert"]) as engine:  # max_position_embeddings 128
        [ok] = engine.embed([list(range(3, 131))])  # exactly the model's length
        assert ok.num_prompt_tokens == 128
        with pytest.raises(InvalidRequestError, match="129 tokens"):
            engine.embed([list(range(3, 132))])


def test_runners_refuse_the_other_kind_of_request(folders):
    from shared.sampling import SamplingParams

    with _engine(folders["llama"]) as engine, pytest.raises(InvalidRequestError, match="pooling") as exc:
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert "embeddings only" in exc.value.message
    with pytest.raises(ModelLoadError, match="--runner pooling"):
        LLMEngine(EngineConfig(model=str(folders["bert"])), load_tokenizer_files=False)
    with LLMEngine(
        EngineConfig(model=str(folders["llama"]), num_kv_blocks=16), load_tokenizer_files=False
    ) as engine:
        with pytest.raises(InvalidRequestError, match="--runner pooling"):
            engine.embed([[5, 6, 7]])


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_async_scheduling_plans_the_next_chunk_ahead(folders, tmp_path, family):
    """As on a GPU: the next step (a prefill's next chunk) is planned while one is in flight."""
    import shutil

    folder = Path(shutil.copytree(folders[family], tmp_path / family))
    write_sentence_transformers_files(folder, "mean", normalize=True)
    prompts = _prompts(8)
    with _engine(folder, async_scheduling=True) as engine:
        results = engine.embed(prompts)
    _assert_close([r.embedding for r in results], _reference(folder, prompts, "mean", True))


def test_bert_loads_prefixed_and_old_layernorm_names(folders, tmp_path):
    """A checkpoint saved from a BERT head model (`bert.` prefix, a pooler, an MLM head) with
    LayerNorm's old `gamma`/`beta` names embeds as the plain one does."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(folders["bert"], tmp_path / "bert"))
    tensors = load_file(folder / "model.safetensors")
    renamed = {
        "bert."
        + name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): tensor
        for name, tensor in tensors.items()
    }
    renamed["cls.predictions.bias"] = torch.zeros(512)
    (folder / "model.safetensors").unlink()
    save_file(renamed, folder / "model.safetensors")
    prompts = _prompts(9)
    with _engine(folders["bert"]) as engine:
        plain = [r.embedding for r in engine.embed(prompts)]
    with _engine(folder) as engine:
        renamed_results = [r.embedding for r in engine.embed(prompts)]
    for a, b in zip(plain, renamed_results, strict=True):
        np.testing.assert_array_equal(a, b)
