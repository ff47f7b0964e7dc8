"""A gateway process loads tokenizers and chat templates, never the model code: building and
starting the app leaves no `workers` module imported. (torch is there all the same:
transformers imports it when it is installed, for any tokenizer.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: the test process itself has imported workers (fixtures use it).
SCRIPT = r"""
import asyncio, json, sys

from aiohttp.test_utils import TestClient, TestServer

from gateway.http.app import create_app
from gateway.tokens.models import MODELS
from gateway.core.settings import GatewaySettings, ModelSpec


async def main(url, folder):
    app = create_app(GatewaySettings(redis_url=url, models=[ModelSpec.from_path(folder)], poll_s=0.5))
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/health")).status == 200
        (served,) = list(app[MODELS])
        assert served.tokenizer is not None and served.encode_text("Hello there")  # a real tokenizer, used
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("workers", "scheduler"))
    print(json.dumps(loaded))


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_gateway_app_imports_no_worker_code(redis_server, smollm2):
    done = subprocess.run([sys.executable, "-c", SCRIPT, redis_server.url, str(smollm2)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m.split(".")[0] == "workers"] == []
