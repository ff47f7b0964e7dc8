"""A chat's ids from its pieces' cached ids (gateway/tokens/token_pieces.py) are exactly the ids of the
whole text, and the encoder is refused for tokenizers where that does not hold by construction."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from gateway.tokens.models import _load_tokenizer
from gateway.tokens.token_pieces import PieceEncoder
from shared.tokenizer import encode_ids

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
ODD = ["<|im_", "|>", "<|", "im_end", "<|im_start|><|im_end|>", "\n", "\n\n", "  ", "\t", " ",
       "ünïcödé", "日本語", "🙂🚀", "\u200b", "e\u0301", "ﬁ", "''", "'s", "123456", "x" * 300]
WORDS = ["river", "mountain", "The", "a", "city,", "garden.", "don't", "I'm", "?", "!!", "--", "(x)"]


def random_text(rng: random.Random, max_parts: int = 40) -> str:
    parts = []
    for _ in range(rng.randint(0, max_parts)):
        roll = rng.random()
        parts.append(rng.choice(SPECIALS) if roll < 0.08 else rng.choice(ODD) if roll < 0.3 else
                     rng.choice(WORDS))
        parts.append(rng.choice(["", " ", " ", "\n", "  "]))
    return "".join(parts)


def random_chat(rng: random.Random, system: str) -> list[dict]:
    messages = [{"role": "system", "content": system}] if rng.random() < 0.8 else []
    for turn in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": random_text(rng) if rng.random() < 0.9 else ""})
        if turn and rng.random() < 0.3:
            messages.append({"role": "tool", "content": random_text(rng, 5)})
        messages.append({"role": "assistant", "content": random_text(rng)})
    return messages[:-1] if rng.random() < 0.7 else messages


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather <|im_end|> now",
                                           "parameters": {"type": "object", "properties": {}}}}]


def test_chats_encode_exactly_as_their_whole_text(smollm2) -> None:
    tokenizer = _load_tokenizer(str(smollm2))
    pieces = PieceEncoder.for_tokenizer(tokenizer, max_bytes=64 << 10)  # small: evictions happen too
    assert pieces is not None
    rng = random.Random(0)
    systems = [random_text(rng, 200) for _ in range(3)] + [""]
    for _ in range(400):
        messages = random_chat(rng, rng.choice(systems))
        tools = TOOLS if rng.random() < 0.2 else None
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=False)
        assert pieces.encode(text) == encode_ids(tokenizer, text, add_special_tokens=False), text
    for _ in range(300):  # bare texts: tokens side by side, at the ends, alone
        text = random_text(rng)
        assert pieces.encode(text) == encode_ids(tokenizer, text, add_special_tokens=False), text
    for text in ["", "<|im_end|>", "<|im_end|><|im_end|>", " <|im_end|> ", "<|im_start|>\n"]:
        assert pieces.encode(text) == encode_ids(tokenizer, text, add_special_tokens=False), text


def test_a_shared_system_prompt_is_encoded_once(smollm2) -> None:
    tokenizer = _load_tokenizer(str(smollm2))
    pieces = PieceEncoder.for_tokenizer(tokenizer)
    system = " ".join(["river mountain city garden market music story"] * 100)
    for user in ("hello", "what now?", "tell me more"):
        text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": user}],
                                             add_generation_prompt=True, tokenize=False)
        assert pieces.encode(text) == encode_ids(tokenizer, text, add_special_tokens=False)
    # once: "system\n" + the prompt, "\n" and "assistant\n"; each "user\n" + its turn
    assert pieces.misses == 3 + 3


class _Wrapped:
    """What the gateway holds: a tokenizer with a Rust backend."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend_tokenizer = backend


def _trained(*, normalizer=None, pre_tokenizer=None, tokens=None) -> _Wrapped:
    tokens = tokens or [AddedToken("<|end|>", special=True, normalized=False)]
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    rng = random.Random(1)
    corpus = [random_text(rng) for _ in range(300)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=
                                                            pre_tokenizers.ByteLevel.alphabet()))
    backend.add_special_tokens(tokens)
    return _Wrapped(backend)


def test_a_per_piece_normalizer_keeps_the_encoder_and_its_exactness() -> None:
    tokenizer = _trained(normalizer=normalizers.NFC(), tokens=[
        AddedToken("<|end|>", special=True, normalized=False), AddedToken("<|im_end|>", normalized=False),
        AddedToken("<|im_", normalized=False)])
    pieces = PieceEncoder.for_tokenizer(tokenizer)
    assert pieces is not None
    rng = random.Random(2)
    for _ in range(300):
        text = random_text(rng).replace("<|endoftext|>", "<|end|>")
        assert pieces.encode(text) == encode_ids(tokenizer, text, add_special_tokens=False), text


@pytest.mark.parametrize("make", [
    lambda: _trained(normalizer=normalizers.Lowercase()),  # (not known to act per piece)
    lambda: _trained(pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="first")),  # the first piece only
    lambda: _trained(tokens=[AddedToken("<|end|>", lstrip=True, special=True, normalized=False)]),
    lambda: _trained(tokens=[AddedToken("<|end|>", rstrip=True, special=True, normalized=False)]),
    lambda: _trained(tokens=[AddedToken("end", single_word=True, normalized=False)]),
    lambda: _trained(normalizer=normalizers.NFC(), tokens=[AddedToken("<|end|>", normalized=True)]),
])
def test_tokenizers_whose_pieces_may_not_add_up_get_no_encoder(make) -> None:
    assert PieceEncoder.for_tokenizer(make()) is None


def test_special_tokens_encoded_as_text_get_no_encoder() -> None:
    tokenizer = _trained()
    tokenizer.backend_tokenizer.encode_special_tokens = True
    assert PieceEncoder.for_tokenizer(tokenizer) is None


@pytest.mark.parametrize("make", [
    lambda: _trained(pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="first")),
    lambda: _trained(tokens=[AddedToken("<|end|>", lstrip=True, special=True, normalized=False)]),
    lambda: _trained(tokens=[AddedToken("<|end|>", rstrip=True, special=True, normalized=False)]),
])
def test_those_checks_matter_pieces_encoded_alone_there_differ(make) -> None:
    tokenizer = make()
    forced = PieceEncoder(tokenizer.backend_tokenizer)
    texts = [f"say {word} <|end|> then\n{word}<|end|>{word}" for word in WORDS]
    assert any(forced.encode(t) != encode_ids(tokenizer, t, add_special_tokens=False) for t in texts)


def test_a_served_model_encodes_chats_from_their_pieces(smollm2) -> None:
    from gateway.core.settings import ModelSpec
    from gateway.tokens.models import ServedModel

    model = ServedModel.load(ModelSpec.from_path(str(smollm2)))
    system = {"role": "system", "content": "You answer in rhymes. " * 50}
    for user in ("hi", "and now?"):
        text, ids = model.encode_chat([system, {"role": "user", "content": user}])
        assert ids == encode_ids(model.tokenizer, text, add_special_tokens=False)
    assert model._pieces.misses == 3 + 2  # the system turn once
