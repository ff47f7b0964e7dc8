"""LoRA adapters on the llama family: an adapter read from its PEFT folder (`adapter.py`), the
projections that add each token's adapter delta (`layers.py`), and the slots and host cache a
runner keeps them in (`manager.py`)."""
