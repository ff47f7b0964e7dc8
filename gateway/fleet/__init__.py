"""The fleet as the gateway sees it while it serves: which schedulers are alive (`tracker.py`),
how deep each model's queue is (`queue_depth.py`, admission against --max-queue), how long
calls queued (`queue_times.py`), which replica caches a prompt's prefix (`routing.py`), and the
schedulers' engine metrics on /metrics (`engine_metrics.py`)."""
