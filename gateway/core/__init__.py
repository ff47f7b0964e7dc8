"""What every room of the gateway shares: a process's settings (`settings.py`), its Prometheus
metrics (`metrics.py`), background tasks (`tasks.py`), the typed keys of the app's process-wide
resources (`appkeys.py`) and the bases of HTTP bodies, with the error body every route may answer
(`shapes.py`)."""
