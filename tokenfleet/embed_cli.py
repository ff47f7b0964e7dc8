"""`tokenfleet embed`: embeddings in-process, no Redis (the pooling runner's `generate`).

    tokenfleet embed --model BAAI/bge-small-en-v1.5-folder "first text" "second text"

prints one JSON object per input: `embedding` (floats), `num_prompt_tokens`.
"""

from __future__ import annotations

import argparse
import json

from tokenfleet.engine_flags import add_engine_flags, engine_config
from tokenfleet.flags import flag


def add_embed_parser(commands) -> None:
    embed = commands.add_parser("embed", help="offline embeddings in-process (no Redis; --runner pooling)")
    add_engine_flags(embed, exclude=("runner",))
    flag(embed, "dimensions", type=int, help="cut each embedding to this many dimensions (Matryoshka models)")
    flag(embed, "truncate-prompt-tokens", type=int,
         help="keep only each input's last N tokens (else an input past the model's length is refused)")
    embed.add_argument("texts", nargs="+", metavar="TEXT")


def cmd_embed(args: argparse.Namespace) -> int:
    import dataclasses

    from scheduler.engine import LLMEngine

    args.runner = "pooling"
    config = dataclasses.replace(engine_config(args), runner="pooling")
    with LLMEngine(config) as engine:
        results = engine.embed(args.texts, dimensions=args.dimensions,
                               truncate_prompt_tokens=args.truncate_prompt_tokens)
    for result in results:
        print(json.dumps({"embedding": result.embedding.tolist(),
                          "num_prompt_tokens": result.num_prompt_tokens}))
    return 0
