"""Server-sent events as a client reads them, written once for the tests and the scripts: the
data field of a line (`data: X` gives X; `id:`, `event:`, comments and blank lines give None),
of a whole body, or of a streamed response as each line arrives."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator

DONE = "[DONE]"  # the data of OpenAI's last event


def data_of(line: bytes | str) -> str | None:
    if isinstance(line, bytes):
        line = line.decode()
    line = line.rstrip("\r\n")
    return line[5:].removeprefix(" ") if line.startswith("data:") else None


def data_fields(text: str) -> list[str]:
    """The data of every event of a whole body, in order."""
    return [data for line in text.splitlines() if (data := data_of(line)) is not None]


async def data_lines(content: AsyncIterable[bytes]) -> AsyncIterator[tuple[float, str]]:
    """(time.monotonic() when it arrived, its data) of each data line of a streamed body (an
    aiohttp response's `content`), as it arrives."""
    async for line in content:
        if (data := data_of(line)) is not None:
            yield time.monotonic(), data
