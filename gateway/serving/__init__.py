"""What every endpoint shares to serve a call: the queued work a body becomes (`plan.py`), its
trip through Redis (`store.py`: queue, cancel, read back; `pubsub.py`: one pub/sub connection
per process, routed to per-request inboxes; `follow.py`: each event once, in order, gaps filled
from the `tf:res` record; `records.py`: that record read), Server-Sent Event frames (`sse.py`),
and the steps every generating handler takes (`handlers.py`: read the body, admit, queue,
follow, stream)."""
