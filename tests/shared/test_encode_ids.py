"""encode_ids: the same ids as the Hugging Face call, through the GIL-free Rust backend."""

from __future__ import annotations

import pytest

from shared.tokenizer import encode_ids, load_tokenizer

TEXTS = [
    " ".join(["river mountain city garden market music story"] * 50),
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n",
    "  leading spaces\n\nand ünïcödé 日本語 🙂",
    "",
]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_ids_are_the_hugging_face_calls(smollm2, tiny_checkpoints, add_special_tokens) -> None:
    tokenizers = [load_tokenizer(smollm2), *(load_tokenizer(f) for f in tiny_checkpoints.values())]
    tokenizers = [t for t in tokenizers if t is not None]
    assert tokenizers and all(getattr(t, "backend_tokenizer", None) is not None for t in tokenizers)
    for tokenizer in tokenizers:
        for text in TEXTS:
            want = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
            assert encode_ids(tokenizer, text, add_special_tokens=add_special_tokens) == want, text


def test_a_tokenizer_without_a_backend_is_called_as_before() -> None:
    class Slow:
        def __call__(self, text, add_special_tokens=True):
            class Out:
                input_ids = [len(text), int(add_special_tokens)]
            return Out()

    assert encode_ids(Slow(), "abc", add_special_tokens=False) == [3, 0]
