"""The card-and-model rule for max_num_seqs and the largest CUDA graph (shared/batch_sizing.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shared.batch_sizing import (
    GIB,
    MIN_NUM_SEQS,
    TYPICAL_CONTEXT,
    choose_batch_sizing,
    kv_bytes_per_token,
    sizing_for,
    weight_bytes_estimate,
)
from shared.config import EngineConfig
from shared.model_config import ModelConfig, load_model_config

# Cards as the driver reports them: 24 GB (~23.6 GiB), A100 40 GB, H100 80 GB, H200.
CARD_24, CARD_40, CARD_80, CARD_141 = (int(g * GIB) for g in (23.6, 39.4, 79.1, 139.8))


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int, *,
           vocab: int = 128256, tied: bool = False) -> ModelConfig:
    return ModelConfig(model_type="llama", hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=None, tie_word_embeddings=tied, attention_bias=False)


LLAMA_1B = _llama(2048, 8192, 16, 32, 8, 64, tied=True)
LLAMA_8B = _llama(4096, 14336, 32, 32, 8, 128)
LLAMA_70B = _llama(8192, 28672, 80, 64, 8, 128)


def _sizing(model: ModelConfig, card: int, **fields):
    return sizing_for(EngineConfig.for_device("cuda", model="m", **fields), model, card)


def test_shape_estimates_match_the_published_model_sizes():
    # Llama-3-8B: 8.03e9 parameters, 16.06 GB in bf16; 128 KiB of K/V per token.
    assert weight_bytes_estimate(LLAMA_8B, dtype_bytes=2) == pytest.approx(16.06e9, rel=0.01)
    assert kv_bytes_per_token(LLAMA_8B, kv_dtype_bytes=2) == 128 * 1024
    # FP8 linear weights: about half; TP 2 halves a rank's weights and K/V heads.
    assert weight_bytes_estimate(LLAMA_8B, dtype_bytes=2, linear_bytes=1) < 0.6 * 16.06e9
    assert weight_bytes_estimate(LLAMA_70B, dtype_bytes=2, num_ranks=4) == pytest.approx(70.6e9 / 2, rel=0.01)
    whole = kv_bytes_per_token(LLAMA_70B, kv_dtype_bytes=2)
    assert kv_bytes_per_token(LLAMA_70B, kv_dtype_bytes=2, tp=2) == whole // 2


def test_an_8b_model_runs_1024_sequences_on_80_and_141_gib_cards_and_fewer_on_smaller_ones():
    big = _sizing(LLAMA_8B, CARD_80)
    assert (big.max_num_seqs, big.max_graph_batch) == (1024, 512)
    assert "tier" in big.reason
    assert _sizing(LLAMA_8B, CARD_141).max_num_seqs == 1024
    # A100 40 GB: ~12 GiB of KV pool, ~300 sequences of 320 tokens: the pool binds below the tier's 512.
    mid = _sizing(LLAMA_8B, CARD_40)
    assert 256 <= mid.max_num_seqs < 512 and mid.max_num_seqs % 8 == 0
    assert mid.max_graph_batch == 256 and "KV pool" in mid.reason
    # 24 GB: the weights and the activation reserve leave no pool to speak of: the floor.
    assert _sizing(LLAMA_8B, CARD_24).max_num_seqs == MIN_NUM_SEQS


def test_a_small_model_takes_its_card_tier():
    for card, (seqs, graphs) in [(CARD_24, (256, 128)), (CARD_40, (512, 256)), (CARD_80, (1024, 512)),
                                 (CARD_141, (1024, 512))]:
        sizing = _sizing(LLAMA_1B, card)
        assert (sizing.max_num_seqs, sizing.max_graph_batch) == (seqs, graphs), card / GIB


def test_a_70b_model_is_bound_by_its_kv_pool_until_it_is_sharded():
    one_card = _sizing(LLAMA_70B, CARD_141)  # 141 GB of weights on a 141 GiB card: nothing left
    assert one_card.max_num_seqs == MIN_NUM_SEQS
    assert _sizing(LLAMA_70B, CARD_80, tp=2).max_num_seqs == MIN_NUM_SEQS  # 66 GiB a rank: no pool
    four = _sizing(LLAMA_70B, CARD_80, tp=4)  # ~22 GiB of pool a rank, 80 KiB a token
    assert MIN_NUM_SEQS < four.max_num_seqs < 1024 and "KV pool" in four.reason
    assert _sizing(LLAMA_70B, CARD_80, tp=8).max_num_seqs == 1024
    assert _sizing(LLAMA_70B, CARD_80, tp=4, pp=2).max_num_seqs == 1024  # pp halves a rank's layers


def test_an_fp8_kv_cache_holds_twice_the_sequences_where_the_pool_binds():
    bf16 = _sizing(LLAMA_8B, CARD_40)
    fp8 = _sizing(LLAMA_8B, CARD_40, kv_cache_dtype="fp8")
    assert fp8.max_num_seqs == 512 and bf16.max_num_seqs < 512  # fp8 reaches the tier's cap


def test_the_kv_bound_is_the_pool_over_a_typical_context_rounded_to_graph_steps():
    block = kv_bytes_per_token(LLAMA_8B, kv_dtype_bytes=2)
    sizing = choose_batch_sizing(card_bytes=CARD_80, weight_bytes=0, kv_bytes_per_token=block,
                                 activation_bytes=int(CARD_80 * 0.5) - 101 * block * TYPICAL_CONTEXT,
                                 memory_fraction=0.5)
    assert sizing.max_num_seqs == 96  # 101 sequences fit, rounded down to a multiple of 8
    with pytest.raises(ValueError):
        choose_batch_sizing(card_bytes=0, weight_bytes=0, kv_bytes_per_token=block, activation_bytes=0,
                            memory_fraction=0.9)


def test_explicit_values_win_over_the_card_and_graphs_stay_under_the_tier_cap():
    sizing = _sizing(LLAMA_8B, CARD_80)
    chosen = EngineConfig.for_device("cuda", sizing=sizing, model="m")
    assert (chosen.max_num_seqs, chosen.cuda_graph_max_batch_size) == (1024, 512)
    given = EngineConfig.for_device("cuda", sizing=sizing, model="m", max_num_seqs=64)
    assert (given.max_num_seqs, given.cuda_graph_max_batch_size) == (64, 64)
    more = EngineConfig.for_device("cuda", sizing=sizing, model="m", max_num_seqs=2048)
    assert (more.max_num_seqs, more.cuda_graph_max_batch_size) == (2048, 512)
    graphs = EngineConfig.for_device("cuda", sizing=sizing, model="m", cuda_graph_max_batch_size=1024)
    assert graphs.cuda_graph_max_batch_size == 1024
    # Without a card, the table's fallback as before.
    assert EngineConfig.for_device("cuda", model="m").max_num_seqs == 512


def test_the_rule_reads_the_model_folder(tmp_path):
    raw = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from_folder = load_model_config(tmp_path)
    assert dataclasses.replace(from_folder, eos_token_ids=[], max_position_embeddings=8192,
                               rms_norm_eps=1e-5, rope_theta=500000.0) == LLAMA_8B
    config = EngineConfig.for_device("cuda", model=str(tmp_path))
    assert sizing_for(config, from_folder, CARD_40) == _sizing(LLAMA_8B, CARD_40)


def test_a_kv_pool_the_user_fixed_bounds_the_sequences():
    """--num-kv-blocks 2048 (32k tokens) on an 80 GB card: the pool holds ~100 typical
    sequences, whatever the card's free memory would have given."""
    sizing = _sizing(LLAMA_8B, CARD_80, num_kv_blocks=2048)
    assert sizing.max_num_seqs == 2048 * 16 // TYPICAL_CONTEXT // 8 * 8
    assert _sizing(LLAMA_8B, CARD_80).max_num_seqs == 1024
