"""What the gateway + pub/sub path adds to each streamed token, matching every content chunk a
client got (testkit.chat_streams) to the token event a listener on Redis got for it
(testkit.redis_queue.EventListener): by request id, and by how much text has arrived (a chunk
carries the text of its event). Both clocks must be the same machine's CLOCK_MONOTONIC."""

from __future__ import annotations

from testkit.chat_streams import Stream
from testkit.redis_queue import Event


def latencies(streams: list[Stream],
              events: dict[str, list[Event]]) -> tuple[list, list, list, list, int, int]:
    """(client ITL gaps, step intervals at the listener, added ITL per token, delivery lags,
    matched, unmatched). The added ITL of a token: the gap between it and the stream's previous
    token at the client, minus the gap between the same two events at the listener."""
    client_gaps, step_gaps, added, added_itl = [], [], [], []
    matched = unmatched = 0
    for stream in streams:
        if stream.error is not None or stream.req_id is None:
            continue
        client_gaps += [b[0] - a[0] for a, b in zip(stream.chunks, stream.chunks[1:], strict=False)]
        evs = sorted(events.get(stream.req_id, []), key=lambda e: e.seq)
        step_gaps += [b.t - a.t for a, b in zip(evs, evs[1:], strict=False)]
        at_length: dict[int, float] = {}  # text length so far -> arrival of the event that reached it
        length = 0
        for ev in evs:
            if ev.text:
                length += len(ev.text)
                at_length[length] = ev.t
        length = 0
        previous = None  # (client arrival, listener arrival) of the stream's previous token
        for t, content in stream.chunks:
            length += len(content)
            t_event = at_length.get(length)
            if t_event is None:
                unmatched += 1
                previous = None
            else:
                matched += 1
                added.append(t - t_event)
                if previous is not None:
                    added_itl.append((t - previous[0]) - (t_event - previous[1]))
                previous = (t, t_event)
    return client_gaps, step_gaps, added_itl, added, matched, unmatched
