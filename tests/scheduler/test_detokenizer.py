from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from scheduler.detokenizer import (
    IncrementalDetokenizer,
    StopStringFilter,
    find_stop_string,
    num_partial_stop_chars,
)

CORPUS = [
    "café crème brûlée à la française, déjà vu",
    "日本語のテキスト 日本 東京 日本語",
    "emoji 🎉🚀 party 👍🏽 thumbs",
    "hello world, the quick brown fox jumps over the lazy dog",
]
SNIPPETS = ["a", "b", " ", "é", "è", "日", "本", "語", "🎉", "👍🏽", "hello", " world", "\n", "x"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in memory: merges whole multi-byte chars, keeps all bytes."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<eos>", pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )


def byte_token_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per UTF-8 byte, so multi-byte characters are split across tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    byte_to_char = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in byte_to_char):
        byte_to_char[b] = chr(256 + n)
    return tokenizer.convert_tokens_to_ids([byte_to_char[b] for b in text.encode()])


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Deltas for each token, then what finish() flushes."""
    return [detokenizer.add_token(t) for t in token_ids] + [detokenizer.finish()]


def random_text(rng: random.Random, num_snippets: int) -> str:
    return "".join(rng.choice(SNIPPETS) for _ in range(num_snippets))


def test_deltas_concatenate_to_full_decode_for_random_ids(tokenizer) -> None:
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    for _ in range(300):
        prompt_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 8))]
        output_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        text = "".join(stream(detokenizer, output_ids))
        assert text == tokenizer.decode(output_ids, skip_special_tokens=True)


def test_character_split_over_byte_tokens_is_emitted_whole_once_complete(tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("party "))
    deltas = [detokenizer.add_token(t) for t in byte_token_ids(tokenizer, "🎉")]
    assert deltas == ["", "", "", "🎉"]


def test_valid_text_streams_without_replacement_chars(tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(100):
        text = random_text(rng, 12)
        # Mix byte tokens and trained merges so splits fall everywhere.
        token_ids = byte_token_ids(tokenizer, text) if rng.random() < 0.5 else tokenizer.encode(text)
        detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("hello"))
        deltas = [detokenizer.add_token(t) for t in token_ids]
        assert all("\ufffd" not in delta for delta in deltas)
        assert "".join(deltas) == text
        assert detokenizer.finish() == ""


def test_incomplete_trailing_character_is_flushed_at_finish(tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("a"))
    partial_char = byte_token_ids(tokenizer, "日")[:2]
    assert [detokenizer.add_token(t) for t in partial_char] == ["", ""]
    assert detokenizer.finish() == tokenizer.decode(partial_char)


def test_bytes_that_can_never_become_a_character_are_sent_at_once(tokenizer) -> None:
    # A lone continuation byte, then a lead byte cut short by a plain letter: no later byte makes
    # either valid, so each goes out as U+FFFD with its token (a full decode shows the same).
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("a"))
    lone_continuation, lead = byte_token_ids(tokenizer, "é")[1], byte_token_ids(tokenizer, "é")[0]
    assert detokenizer.add_token(lone_continuation) == "\ufffd"
    assert detokenizer.add_token(lead) == ""  # may still complete
    assert detokenizer.add_token(tokenizer.encode("b")[0]) == "\ufffdb"


def test_text_before_a_character_still_arriving_is_sent_without_waiting_for_it(tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("a"))
    word, char = tokenizer.encode(" hello"), byte_token_ids(tokenizer, "日")
    deltas = [detokenizer.add_token(t) for t in word + char]
    assert "".join(deltas[: len(word)]) == " hello"
    assert deltas[len(word):] == ["", "", "日"]


def test_a_random_model_over_a_vocabulary_of_byte_strings_streams_nearly_every_token() -> None:
    # The seed model's stand-in: a synthetic qwen.tiktoken of 151,643 ranks, mostly random byte
    # strings, and random ids as a random-weight model samples them. Holding back every delta
    # that ended in U+FFFD left half of the tokens without text, in runs of up to 11.
    from shared.qwen_tokenizer import QwenTokenizer
    from testkit.qwen_checkpoints import synthetic_ranks

    qwen = QwenTokenizer(synthetic_ranks(151_643))
    rng = random.Random(0)
    num_empty = num_tokens = 0
    for _ in range(20):
        ids = [rng.randrange(151_643) for _ in range(100)]
        detokenizer = IncrementalDetokenizer(qwen, [1, 2, 3])
        deltas = stream(detokenizer, ids)
        assert "".join(deltas) == qwen.decode(ids)
        num_empty += sum(delta == "" for delta in deltas[:-1])
        num_tokens += len(ids)
    assert num_empty / num_tokens < 0.02


def test_special_tokens_are_skipped(tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("a"))
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id] + tokenizer.encode(" world")
    assert "".join(stream(detokenizer, ids)) == "hello world"


def test_prompt_context_keeps_the_space_sentencepiece_drops_at_decode_start() -> None:
    vocab = {"▁hello": 0, "▁world": 1, "<unk>": 2}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Metaspace()
    word_level.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level)
    assert tokenizer.decode([1]) == "world"  # what a context-free decode would stream
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[0])
    assert detokenizer.add_token(1) == " world"
    assert detokenizer.add_token(1) == " world"


def test_each_step_decodes_a_short_window_not_the_whole_output(tokenizer) -> None:
    class RecordingTokenizer:
        max_num_ids = 0

        def decode(self, token_ids, **kwargs) -> str:
            self.max_num_ids = max(self.max_num_ids, len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    recording = RecordingTokenizer()
    detokenizer = IncrementalDetokenizer(recording, tokenizer.encode("hello world again"))
    output_ids = tokenizer.encode(" ".join(CORPUS * 10))
    text = "".join(stream(detokenizer, output_ids))
    assert len(output_ids) > 200
    assert text == tokenizer.decode(output_ids)
    assert recording.max_num_ids <= 10


def test_stop_string_spanning_tokens_is_cut_and_never_partly_streamed(tokenizer) -> None:
    rng = random.Random(2)
    for _ in range(200):
        text = random_text(rng, 15)
        start = rng.randrange(len(text) - 1)
        stop = text[start : start + rng.randint(2, 4)]
        expected = text[: text.find(stop)]
        token_ids = byte_token_ids(tokenizer, text) if rng.random() < 0.5 else tokenizer.encode(text)
        detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("hello"), stop=[stop])
        streamed = ""
        for token_id in token_ids:
            streamed += detokenizer.add_token(token_id)
            assert expected.startswith(streamed)  # nothing of the stop string leaks, ever
            if detokenizer.matched_stop is not None:
                break
        assert detokenizer.matched_stop == stop
        assert streamed + detokenizer.finish() == expected


def test_possible_stop_prefix_is_held_back_then_released_when_ruled_out() -> None:
    stop_filter = StopStringFilter(["abc"])
    assert stop_filter.add_text("xa") == "x"
    assert stop_filter.add_text("b") == ""
    assert stop_filter.add_text("d") == "abd"
    assert stop_filter.matched_stop is None


def test_held_back_text_is_flushed_at_finish() -> None:
    stop_filter = StopStringFilter(["abc"])
    assert stop_filter.add_text("xab") == "x"
    assert stop_filter.finish() == "ab"


def test_text_after_the_stop_string_is_dropped() -> None:
    stop_filter = StopStringFilter(["STOP"])
    assert stop_filter.add_text("one STOP two") == "one "
    assert stop_filter.matched_stop == "STOP"
    assert stop_filter.finish() == ""


def test_earliest_stop_string_in_the_text_wins() -> None:
    stop_filter = StopStringFilter(["world", "lo"])
    assert stop_filter.add_text("hello world") == "hel"
    assert stop_filter.matched_stop == "lo"


def test_without_stop_strings_text_passes_straight_through() -> None:
    stop_filter = StopStringFilter()
    assert stop_filter.add_text("ab") == "ab"
    assert stop_filter.finish() == ""


def test_find_stop_string_searches_only_what_new_text_could_complete() -> None:
    assert find_stop_string("xxSTOPyyyy", ["STOP"], num_new_chars=2) is None
    assert find_stop_string("xxSTOPyyyy", ["STOP"], num_new_chars=5) == (2, "STOP")
    assert find_stop_string("xxSTO", ["STOP"], num_new_chars=5) is None


def test_num_partial_stop_chars_is_the_longest_tail_that_starts_a_stop() -> None:
    assert num_partial_stop_chars("hello wor", ["world", "or"]) == 3
    assert num_partial_stop_chars("hello", ["world"]) == 0
    assert num_partial_stop_chars("world", ["world"]) == 0  # a full match is not partial
