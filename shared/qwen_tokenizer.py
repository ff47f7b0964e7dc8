"""Qwen (v1)'s tokenizer from its `qwen.tiktoken` file, without running the folder's code.

The file holds one `base64(token bytes) rank` per line: a byte-level BPE that tiktoken runs with
Qwen's pre-tokenizer regex. Special tokens are numbered after the ranks: `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`, then `<|extra_0|>` .. `<|extra_204|>`. As Qwen's own tokenizer:
- text is NFC-normalized before encoding;
- a raw prompt may spell special tokens (a hand-written ChatML prompt works), while the chat
  builder encodes each message's text with special tokens as plain text, so a user cannot
  inject `<|im_end|>` through a message;
- decoding joins the tokens' bytes and decodes UTF-8 with replacement, so it is byte-exact and
  an incomplete character shows as U+FFFD until its next bytes come (the incremental
  detokenizer relies on that). Ids past the tokenizer (the model's padded vocabulary rows) have
  no text and decode to nothing.

Chat is ChatML with the default system message "You are a helpful assistant.", built as ids
(role, newline and content encoded apart, as Qwen's chat builder does), so gateway and engine
give the same ids. The object quacks like the part of a Hugging Face tokenizer the rest of the
code uses (`__call__`, `decode`, `eos_token_id`, `chat_template`, `apply_chat_template`).
"""

from __future__ import annotations

import base64
import binascii
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelLoadError

TIKTOKEN_FILE = "qwen.tiktoken"
# Qwen's pre-tokenizer (a public constant of the format): contractions, words with one leading
# non-letter, single digits, punctuation runs, newlines, spaces.
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
NUM_EXTRA_TOKENS = 205
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, *(f"<|extra_{i}|>" for i in range(NUM_EXTRA_TOKENS)))
DEFAULT_SYSTEM = "You are a helpful assistant."
# What the gateway shows as the chat template: the ChatML text of chat_ids (the ids themselves
# are built by chat_ids, not by rendering this).
CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def is_qwen_tiktoken_folder(folder: str | Path) -> bool:
    return (Path(folder) / TIKTOKEN_FILE).exists()


def read_ranks(path: Path) -> dict[bytes, int]:
    """The BPE ranks of a qwen.tiktoken file; a bad line is refused naming the file and line."""
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file (the tokenizer of a Qwen folder)") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a qwen.tiktoken file ({exc})") from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected `base64-token rank`")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as exc:
            raise ModelLoadError(f"{path}: line {number} is not `base64-token rank`: {exc}") from None
        if token in ranks:
            raise ModelLoadError(f"{path}: line {number} repeats a token")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelLoadError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
        raise ModelLoadError(f"{path}: a byte-level BPE needs all 256 single bytes as tokens")
    return ranks


@dataclass
class Encoded:
    input_ids: list[int]


class QwenTokenizer:
    # Qwen's chat stops at the end of a turn, and at a turn the model would open (its own
    # generate does the same); <|endoftext|> is the eos of generation_config.json.
    STOP_TOKENS = (IM_END, IM_START, ENDOFTEXT)
    supports_tools = False  # the gateway answers tools with a 400 (Qwen's ReAct format is not built)

    def __init__(self, ranks: dict[bytes, int]) -> None:
        import tiktoken

        self.special_ids = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
        self._encoding = tiktoken.Encoding("qwen", pat_str=PAT_STR, mergeable_ranks=ranks,
                                           special_tokens=self.special_ids)
        self._special_bytes = {i: name.encode() for name, i in self.special_ids.items()}
        self.vocab_size = len(ranks) + len(SPECIAL_TOKENS)
        self.eos_token_id = self.special_ids[ENDOFTEXT]
        self.stop_token_ids = [self.special_ids[name] for name in self.STOP_TOKENS]
        self.chat_template = CHATML_TEMPLATE

    @classmethod
    def from_folder(cls, folder: str | Path) -> QwenTokenizer:
        return cls(read_ranks(Path(folder) / TIKTOKEN_FILE))

    def __len__(self) -> int:
        return self.vocab_size

    # -- encoding -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw prompt's ids: special tokens spelled in it are special (Qwen's default)."""
        return self._encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def encode_plain(self, text: str) -> list[int]:
        """Ids of text in which special tokens are plain text (each chat message's content)."""
        return self._encoding.encode_ordinary(unicodedata.normalize("NFC", text))

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return Encoded(self.encode(text, add_special_tokens))

    # -- decoding -------------------------------------------------------------------

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        pieces = []
        for token_id in token_ids:
            if token_id in self._special_bytes:
                if not skip_special_tokens:
                    pieces.append(self._special_bytes[token_id])
            elif 0 <= token_id < self.vocab_size:
                pieces.append(self._encoding.decode_single_token_bytes(token_id))
            # else: a padding row of the model's vocabulary, which has no text
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes, in id order, for grammars. A special token is empty: a grammar then
        takes it for what it is (never text inside the answer; the stop ones end it)."""
        return [b"" if i in self._special_bytes else self._encoding.decode_single_token_bytes(i)
                for i in range(self.vocab_size)]

    # -- chat -----------------------------------------------------------------------

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """ChatML ids: <|im_start|>role\\ncontent<|im_end|> per turn, newline between turns,
        the default system turn first when the messages have none, then the assistant's opening."""
        nl = self.encode_plain("\n")
        turns = [(m["role"], _text(m)) for m in messages]
        if not turns or turns[0][0] != "system":
            turns.insert(0, ("system", DEFAULT_SYSTEM))
        ids: list[int] = []
        for i, (role, content) in enumerate(turns):
            if role not in ("system", "user", "assistant") or (role == "system" and i):
                raise ValueError(f"messages[{i}]: role {role!r} is not supported by Qwen's ChatML "
                                 "(a system message first, then user and assistant)")
            if i:
                ids += nl
            ids += [self.special_ids[IM_START], *self.encode_plain(role), *nl, *self.encode_plain(content),
                    self.special_ids[IM_END]]
        if add_generation_prompt:
            ids += [*nl, self.special_ids[IM_START], *self.encode_plain("assistant"), *nl]
        return ids

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False, **_: object):
        """The ChatML prompt as text (tokenize=False) or ids; tools are refused."""
        if tools:
            raise ValueError("tools are not supported for Qwen (v1) chat")
        ids = self.chat_ids(messages, add_generation_prompt)
        return ids if tokenize else self.decode(ids)


def _text(message: dict) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    raise ValueError("message content must be text")
