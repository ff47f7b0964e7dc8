"""The gateway as operators see it: /health, /ready and /metrics (`api.py`), this process's
heartbeat in the fleet registry (`presence.py`), and the fleet at a glance (`fleet_view.py`,
with `redis_shards.py`) on /fleet.json and the status page at / (`status_api.py`,
`status_page.html`)."""
