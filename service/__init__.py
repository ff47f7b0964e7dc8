"""The Redis service around an engine: a scheduler process's intake, step loop and writes.

`scheduler/` is the pure engine (no Redis); this package connects one to the fleet: it reads
request streams, claims and fences each request's `tf:res` record (protocol/), writes each
step's progress from a thread of its own, and publishes its heartbeat and telemetry.
"""
