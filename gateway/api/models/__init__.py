"""The models a call may name: the fronted base models and the LoRA adapters loaded on them
(`adapters.py`), /v1/models and the adapters' load and unload routes (`api.py`)."""
