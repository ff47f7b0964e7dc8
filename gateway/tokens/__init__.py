"""The models this gateway fronts, as text and token ids: each model's tokenizer, chat template
and context window (`models.py`), a chat's ids from its pieces' cached ids (`token_pieces.py`),
and the one thread they run on, off the event loop (`tokenize_pool.py`)."""
