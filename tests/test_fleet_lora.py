"""LoRA adapters through a real `tokenfleet up`, called with the official openai SDK: an adapter
declared with --lora-modules (streamed and not, the same tokens as the in-process engine on
that adapter), one loaded and unloaded at runtime through vLLM's routes, and a tenant's adapter
that other tenants cannot see or call."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from scheduler.engine import LLMEngine
from service.lora_adapters import RECHECK_S
from shared.config import EngineConfig
from shared.net import free_port
from shared.sampling import SamplingParams
from testkit.lora_adapters import make_random_adapter
from tests.fleet_helpers import TINY_CHAT, UpProcess

pytestmark = pytest.mark.slow
PROMPT = [1, 504, 3187, 314, 4302, 28, 2412, 30, 2]  # token ids: the SDK's prompt as a list of ints


def _engine_text(model, adapter) -> str:
    config = EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, enable_lora=True,
                          lora_modules={"pub": str(adapter)})
    with LLMEngine(config) as engine:
        return engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               lora_names=["pub"])[0].text


def _polled_text(base: str, req_id: str) -> str:
    deadline = time.monotonic() + 60
    while True:
        record = httpx.get(f"{base}/v1/requests/{req_id}", headers={"Authorization": "Bearer key-a"}).json()
        if record["status"] in ("completed", "failed", "cancelled", "expired"):
            assert record["status"] == "completed", record
            return record["output"]["text"]
        assert time.monotonic() < deadline, record
        time.sleep(0.2)


def test_adapters_through_up_and_the_openai_sdk(tiny_chat, tmp_path) -> None:
    public = make_random_adapter(tiny_chat, tmp_path / "pub", rank=8, target_modules=["q_proj", "v_proj"])
    private = make_random_adapter(tiny_chat, tmp_path / "mine", rank=4, target_modules=["o_proj"], seed=1)
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"team-a": {"keys": ["key-a"]},
                                               "team-b": {"keys": ["key-b"]}}}))
    port = free_port()
    up = UpProcess(["--port", str(port), "--model", str(tiny_chat), "--num-kv-blocks", "128", "--dtype",
                    "float32", "--tenants-file", str(tenants), "--enable-lora", "--max-loras", "2",
                    "--lora-modules", f"pub={public}", "--lora-root", str(tmp_path)], tmp_path / "home")
    base = f"http://127.0.0.1:{port}"
    a = openai.OpenAI(base_url=f"{base}/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=f"{base}/v1", api_key="key-b", max_retries=0)
    try:
        up.wait_up()
        greedy = {"max_tokens": 8, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
        completion = a.completions.create(model="pub", prompt=PROMPT, **greedy)
        assert completion.model == "pub"
        on_base = a.completions.create(model=TINY_CHAT, prompt=PROMPT, **greedy).choices[0].text
        assert completion.choices[0].text == _engine_text(tiny_chat, public) != on_base
        chunks = a.completions.create(model="pub", prompt=PROMPT, stream=True, **greedy)
        streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert streamed == completion.choices[0].text
        chat = [{"role": "user", "content": "Hello there"}]
        whole = a.chat.completions.create(model="pub", messages=chat, **greedy).choices[0].message.content
        parts = [c.choices[0].delta.content or "" for c in
                 a.chat.completions.create(model="pub", messages=chat, stream=True, **greedy) if c.choices]
        assert "".join(parts) == whole
        cards = {m.id: m for m in a.models.list().data}
        assert cards["pub"].parent == TINY_CHAT and a.models.retrieve("pub").parent == TINY_CHAT
        # Submit-and-poll and a batch job's lines run on the adapter too.
        body = {"model": "pub", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        submitted = httpx.post(f"{base}/v1/requests", json={"kind": "completion", **body},
                               headers={"Authorization": "Bearer key-a"})
        assert submitted.status_code == 202, submitted.text
        assert _polled_text(base, submitted.json()["id"]) == completion.choices[0].text
        line = {"custom_id": "l0", "method": "POST", "url": "/v1/completions", "body": body}
        uploaded = a.files.create(file=("job.jsonl", json.dumps(line).encode()), purpose="batch")
        batch = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                 completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.3)
            batch = a.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        (output,) = [json.loads(x) for x in a.files.content(batch.output_file_id).text.splitlines()]
        assert output["response"]["body"]["choices"][0]["text"] == completion.choices[0].text

        # A tenant loads only from under --lora-root: the schedulers would read any folder it named.
        outside = httpx.post(f"{base}/v1/load_lora_adapter", headers={"Authorization": "Bearer key-b"},
                             json={"lora_name": "mine", "lora_path": str(tmp_path / "..")})
        assert outside.status_code == 403, outside.text
        assert "a tenant may load LoRA adapters only from under" in outside.json()["error"]["message"]
        # team-b loads an adapter of its own at runtime: only team-b sees and calls it.
        loaded = httpx.post(f"{base}/v1/load_lora_adapter", headers={"Authorization": "Bearer key-b"},
                            json={"lora_name": "mine", "lora_path": str(private)})
        assert loaded.status_code == 200, loaded.text
        assert b.completions.create(model="mine", prompt=PROMPT, **greedy).choices[0].text != on_base
        assert "mine" in {m.id for m in b.models.list().data}
        assert "mine" not in {m.id for m in a.models.list().data}
        with pytest.raises(openai.NotFoundError) as refused:
            a.completions.create(model="mine", prompt=PROMPT, **greedy)
        assert refused.value.code == "model_not_found"
        gone = httpx.post(f"{base}/v1/unload_lora_adapter", headers={"Authorization": "Bearer key-a"},
                          json={"lora_name": "mine"})
        assert gone.status_code == 404
        # The operator's adapter: every tenant calls it, none unloads it.
        kept = httpx.post(f"{base}/v1/unload_lora_adapter", headers={"Authorization": "Bearer key-b"},
                          json={"lora_name": "pub"})
        assert kept.status_code == 403, kept.text
        still = a.completions.create(model="pub", prompt=PROMPT, **greedy).choices[0].text
        assert still == completion.choices[0].text
        too_big = httpx.post(f"{base}/v1/load_lora_adapter", headers={"Authorization": "Bearer key-a"},
                             json={"lora_name": "x", "lora_path": str(tmp_path / "nowhere")})
        assert too_big.status_code == 400 and "no such folder" in too_big.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/unload_lora_adapter", headers={"Authorization": "Bearer key-b"},
                          json={"lora_name": "mine"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            b.completions.create(model="mine", prompt=PROMPT, **greedy)
        # "mine" again, from the public adapter's folder: the scheduler reads the new record once
        # it is older than RECHECK_S, and serves the new folder's tensors, not the old ones.
        assert httpx.post(f"{base}/v1/load_lora_adapter", headers={"Authorization": "Bearer key-b"},
                          json={"lora_name": "mine", "lora_path": str(public)}).status_code == 200
        time.sleep(RECHECK_S + 0.2)
        again = b.completions.create(model="mine", prompt=PROMPT, **greedy).choices[0].text
        assert again == completion.choices[0].text
    finally:
        up.stop()
