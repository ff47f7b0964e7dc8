"""A response's streamed events, numbered by `sequence_number`, as a pure function of the
request's events: its output text cut at each of its sequence numbers, and how it ended.

That makes the numbering the same whoever derives it, whenever: the gateway that streams the
response as it runs, or another gateway that rebuilds it later from the `tf:res` record (whose
offsets say where each of the request's events ended). So a client that lost its stream asks
any gateway for the events after the last `sequence_number` it saw, and gets exactly those.

Text goes out as it comes (one `response.output_text.delta` per request event that carries
text). With tools in play the text may turn out to be calls, so nothing is sent until the end;
then the items come out whole (a message's text as one delta, a call's arguments as one).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gateway.api.responses.objects import Outcome, message_item, output_items, response_object
from gateway.serving.records import Delta, ResultRecord

_FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete"}


class ResponseEvents:
    """The events of one response, built step by step: opening(), piece() per request event,
    final() at its end. Each carries the next sequence number, from 0."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.text = ""
        self._next = 0
        self._is_message_open = False  # text mode: the message's item and part were announced
        self.is_tools = spec.get("call_format") is not None

    def _event(self, kind: str, **fields: object) -> dict:
        event = {"type": kind, "sequence_number": self._next, **fields}
        self._next += 1
        return event

    def opening(self) -> list[dict]:
        queued = Outcome("queued")
        first = "queued" if self.spec["background"] else "in_progress"
        return [self._event("response.created", response=response_object(self.spec, queued, status=first,
                                                                          with_output=False)),
                self._event("response.in_progress", response=response_object(
                    self.spec, queued, status="in_progress", with_output=False))]

    def _open_message(self, index: int, item_id: str) -> list[dict]:
        item = message_item(self.spec, "", "in_progress") | {"content": []}
        item["id"] = item_id
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item_id, output_index=index,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _text_delta(self, index: int, item_id: str, text: str) -> dict:
        return self._event("response.output_text.delta", item_id=item_id, output_index=index, content_index=0,
                           delta=text, logprobs=[])

    def _close_message(self, index: int, item: dict) -> list[dict]:
        part = item["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def piece(self, text: str) -> list[dict]:
        """The events of one request event's text."""
        self.text += text
        if self.is_tools or not text:
            return []
        events = []
        item_id = "msg_" + self.spec["req_id"]
        if not self._is_message_open:
            self._is_message_open = True
            events += self._open_message(0, item_id)
        return [*events, self._text_delta(0, item_id, text)]

    def final(self, outcome: Outcome) -> list[dict]:
        """The items' closing events and the response's last event."""
        outcome.text = self.text
        items = output_items(self.spec, outcome)
        events: list[dict] = []
        for index, item in enumerate(items):
            if item["type"] == "message":
                if self.is_tools or not self._is_message_open:
                    events += self._open_message(index, item["id"])
                    if self.is_tools and item["content"][0]["text"]:
                        events.append(self._text_delta(index, item["id"], item["content"][0]["text"]))
                events += self._close_message(index, item)
                continue
            added = item | {"arguments": "", "status": "in_progress"}
            events += [self._event("response.output_item.added", output_index=index, item=added),
                       self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=index, delta=item["arguments"]),
                       self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=item)]
        response = response_object(self.spec, outcome)
        # (OpenAI's reference names no event for a cancelled response: it ends as a failed one
        # does, its response's status saying "cancelled".)
        last = _FINAL_EVENTS.get(response["status"], "response.failed")
        events.append(self._event(last, response=response))
        return events


def split_pieces(record: ResultRecord, after_seq: int, upto_seq: int,
                 decode: Callable[[list[int]], str]) -> list[str]:
    """The text of each request event in (after_seq, upto_seq], cut where the record's offsets
    say each ended."""
    pieces = []
    start = record.position(after_seq, decode)[1]
    for seq in range(after_seq + 1, upto_seq + 1):
        end = record.position(seq, decode)[1]
        pieces.append(record.text[start:end])
        start = end
    return pieces


class Pieces:
    """A request's deltas -> the text of each of its events. A live delta is one event; a
    catch-up (after a hole, a reconnect, a resume) covers several, cut by the record."""

    def __init__(self, read: Callable[[], Awaitable[ResultRecord | None]],
                 decode: Callable[[list[int]], str]) -> None:
        self.read = read
        self.decode = decode
        self.last_seq = 0

    async def of(self, delta: Delta) -> list[str]:
        if delta.seq <= self.last_seq:
            return []
        if delta.seq == self.last_seq + 1:
            pieces = [delta.text]
        else:
            record = await self.read()
            if record is None:  # gone from Redis: what the delta holds, as one
                pieces = [delta.text]
            else:
                pieces = split_pieces(record, self.last_seq, delta.seq, self.decode)
        self.last_seq = delta.seq
        return pieces
