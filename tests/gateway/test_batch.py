"""Batch jobs end to end: a real Redis, real schedulers on a tiny model with SmolLM2's
tokenizer, the gateway's ingester; producers that know nothing of tokenfleet (a plain
`redis` client, the official `openai` client, the CLI)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import pytest_asyncio
import redis

from gateway.core.settings import GatewaySettings, ModelSpec
from gateway.http.app import create_app
from protocol.keys import Keys
from tests.gateway.batch_fleet import (
    TINY_CHAT,
    job_lines,
    read_outputs,
    spawn_ingester,
    spawn_scheduler,
    thread_scheduler,
    wait_for_job,
    wait_written,
)

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scheduler(module_redis, tiny_chat):
    scheduler = thread_scheduler(module_redis.url, tiny_chat)
    yield scheduler
    scheduler.close()


@pytest.fixture
def plain(module_redis) -> redis.Redis:
    return redis.Redis.from_url(module_redis.url)


@pytest.fixture
def gateway_settings(module_redis, tiny_chat) -> GatewaySettings:
    return GatewaySettings(redis_url=module_redis.url, models=[ModelSpec.from_path(str(tiny_chat))],
                           poll_s=0.5, batch_lease_s=2.0)


@pytest_asyncio.fixture
async def gateway(gateway_settings, aiohttp_client):
    return await aiohttp_client(create_app(gateway_settings))


def check_exactly_once(outputs: list[dict], num_lines: int, broken: dict[str, str],
                       max_tokens: int = 6) -> None:
    """One output per line, each custom_id once; good lines answered, bad ones refused."""
    assert len(outputs) == num_lines, f"{len(outputs)} outputs for {num_lines} lines"
    by_index = {o["index"]: o for o in outputs}
    assert sorted(by_index) == list(range(num_lines)), "every line, exactly once"
    named = [o["custom_id"] for o in outputs if o["custom_id"]]
    assert len(named) == len(set(named)), "a custom_id came back twice"
    unreadable = {cid for cid, kind in broken.items() if kind == "json"}  # cut short: no custom_id to read
    assert set(named) == {f"req-{i}" for i in range(num_lines)} - unreadable
    for o in outputs:
        line = o["line"]
        assert (line["custom_id"] or "") == o["custom_id"]
        cid = f"req-{o['index']}"
        if cid in broken:
            assert not o["ok"], (cid, line)
        else:
            assert o["ok"], (cid, line)
            assert o["custom_id"] == cid
            assert line["response"]["status_code"] == 200
            body = line["response"]["body"]
            assert body["object"] in ("chat.completion", "text_completion")
            finish = body["choices"][0]["finish_reason"]
            assert body["usage"]["completion_tokens"] == max_tokens or finish == "stop"


@pytest.mark.asyncio
async def test_a_1000_line_job_from_a_plain_redis_client_comes_back_exactly_once(scheduler, gateway, plain):
    lines, broken = job_lines(1000)
    entry_id = plain.xadd("tf:batch:in", {"job_id": "plain-1", "lines": "\n".join(lines) + "\n"}).decode()
    job = await asyncio.to_thread(wait_for_job, plain, "plain-1")
    assert job["status"] == "completed", job
    assert plain.get(f"tf:batch:entry:{entry_id}") == b"plain-1"
    assert int(job["total"]) == 1000
    assert int(job["completed"]) + int(job["failed"]) == 1000
    assert int(job["failed"]) == len(broken)
    outputs = read_outputs(plain, "plain-1")
    check_exactly_once(outputs, len(lines), broken)
    # Each malformed line's error names its problem.
    by_index = {o["index"]: o["line"] for o in outputs}
    for cid, kind in broken.items():
        line = by_index[int(cid.split("-")[1])]
        error = line["response"]["body"]["error"]
        word = {"json": "JSON", "url": "url", "field": "frobnicate", "long": "context length",
                "method": "method"}[kind]
        assert word in error["message"] or word == (error["param"] or ""), (kind, error)
        assert line["response"]["status_code"] == 400
    # A greedy line's output is what the REST route answers for the same body.
    line = json.loads(lines[1])
    rest = await gateway.post("/v1/chat/completions", json=line["body"])
    assert rest.status == 200
    batch_body = by_index[1]["response"]["body"]
    rest_body = await rest.json()
    assert batch_body["choices"][0]["message"]["content"] == rest_body["choices"][0]["message"]["content"]
    metrics = await (await gateway.get("/metrics")).text()
    assert f'tokenfleet_batch_lines_total{{status="failed"}} {float(len(broken))}' in metrics
    assert f'tokenfleet_batch_lines_total{{status="completed"}} {float(1000 - len(broken))}' in metrics
    assert 'tokenfleet_batch_jobs_total{status="completed"} 1.0' in metrics
    # The job's working keys are gone; nothing is left queued.
    assert not plain.exists(Keys().batch_lines("plain-1"), Keys().batch_written("plain-1"),
                            Keys().result("plain-1.1.0"))
    assert not plain.sismember("tf:batch:active", "plain-1")


@pytest.mark.asyncio
async def test_the_same_job_through_the_openai_clients_files_and_batches_calls(scheduler, gateway, plain):
    lines, broken = job_lines(1000, chat_only=True)
    sdk = openai.AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        uploaded = await sdk.files.create(file=("job.jsonl", ("\n".join(lines)).encode()), purpose="batch")
        assert uploaded.bytes > 0 and uploaded.purpose == "batch"
        assert (await sdk.files.retrieve(uploaded.id)).filename == "job.jsonl"
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={"team": "evals"})
        assert batch.status == "validating" and batch.metadata == {"team": "evals"}
        deadline = time.monotonic() + 180
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.3)
            batch = await sdk.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (1000, 1000 - len(broken), len(broken))
        assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
        good = (await sdk.files.content(batch.output_file_id)).text.splitlines()
        bad = (await sdk.files.content(batch.error_file_id)).text.splitlines()
        assert len(good) == 1000 - len(broken) and len(bad) == len(broken)
        outputs = [json.loads(line) for line in good + bad]
        ids = [o["custom_id"] for o in outputs if o["custom_id"]]
        assert len(ids) == len(set(ids))
        assert all(json.loads(line)["response"]["body"]["object"] == "chat.completion" for line in good)
        listed = await sdk.batches.list(limit=100)
        assert batch.id in [b.id for b in listed.data]
        with pytest.raises(openai.ConflictError):
            await sdk.batches.cancel(batch.id)  # a completed batch cannot be cancelled
        with pytest.raises(openai.NotFoundError):
            await sdk.batches.retrieve("batch_nope")
        with pytest.raises(openai.NotFoundError):
            await sdk.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                     completion_window="24h")
        with pytest.raises(openai.BadRequestError):
            await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                     completion_window="24h")
        await sdk.files.delete(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.files.retrieve(uploaded.id)
    finally:
        await sdk.close()


@pytest.mark.asyncio
async def test_cancelling_a_running_job_accounts_for_every_line_once(scheduler, gateway, plain):
    lines, _ = job_lines(1000, bad=False, max_tokens=24)
    plain.xadd("tf:batch:in", {"job_id": "cancel-1", "lines": "\n".join(lines)})
    await asyncio.to_thread(wait_written, plain, "cancel-1", 50)
    response = await gateway.post("/v1/batches/cancel-1/cancel")
    assert response.status == 200
    assert (await response.json())["status"] in ("cancelling", "cancelled")
    job = await asyncio.to_thread(wait_for_job, plain, "cancel-1")
    assert job["status"] == "cancelled" and job.get("cancelled_at")
    outputs = read_outputs(plain, "cancel-1")
    assert sorted(o["index"] for o in outputs) == list(range(1000))
    assert int(job["completed"]) + int(job["failed"]) == 1000
    codes = {o["line"]["error"]["code"] for o in outputs if not o["ok"]}
    assert codes == {"batch_cancelled"}
    assert 50 <= int(job["completed"]) < 1000
    assert not plain.exists(Keys().batch_lines("cancel-1"))
    again = await gateway.post("/v1/batches/cancel-1/cancel")  # cancelling twice is harmless
    assert again.status == 200 and (await again.json())["status"] == "cancelled"


@pytest.mark.asyncio
async def test_a_job_past_its_completion_window_expires_with_every_line_accounted_for(scheduler, gateway,
                                                                                     plain):
    lines, _ = job_lines(1000, bad=False, max_tokens=24)
    plain.xadd("tf:batch:in", {"job_id": "expire-1", "lines": "\n".join(lines), "completion_window": "2s"})
    job = await asyncio.to_thread(wait_for_job, plain, "expire-1")
    assert job["status"] == "expired" and job.get("expired_at")
    outputs = read_outputs(plain, "expire-1")
    assert sorted(o["index"] for o in outputs) == list(range(1000))
    assert {o["line"]["error"]["code"] for o in outputs if not o["ok"]} == {"batch_expired"}
    assert int(job["failed"]) > 0


@pytest.mark.asyncio
async def test_jobs_that_cannot_run_fail_with_an_error_that_names_the_problem(scheduler, gateway, plain):
    good = job_lines(2, bad=False)[0]
    cases = {
        "no-model": ({"lines": "\n".join(good), "model": "gpt-17"}, "gpt-17"),
        "bad-field": ({"lines": "\n".join(good), "priority": "high"}, "priority"),
        "empty": ({"lines": "\n\n"}, "no lines"),
        "no-input": ({"model": TINY_CHAT}, "lines"),
        "bad-window": ({"lines": "\n".join(good), "completion_window": "soon"}, "completion_window"),
        "bad-metadata": ({"lines": "\n".join(good), "metadata": "[1]"}, "metadata"),
        "bad-endpoint": ({"lines": "\n".join(good), "endpoint": "/v1/moderations"}, "endpoint"),
        "no-file": ({"input_file_id": "file-missing"}, "file-missing"),
    }
    for job_id, (fields, _) in cases.items():
        plain.xadd("tf:batch:in", {"job_id": job_id, **fields})
    bad_id_entry = plain.xadd("tf:batch:in", {"job_id": "bad id!", "lines": good[0]}).decode()
    for job_id, (_, word) in cases.items():
        job = await asyncio.to_thread(wait_for_job, plain, job_id, timeout_s=30)
        assert job["status"] == "failed", (job_id, job)
        errors = json.loads(job["errors"])
        assert word in errors[0]["message"], (job_id, errors)
        response = await gateway.get(f"/v1/batches/{job_id}")
        assert (await response.json())["errors"]["data"][0]["message"] == errors[0]["message"]
    # An unusable job_id: the job is named after its entry, findable from the entry id.
    derived = await asyncio.to_thread(_entry_job, plain, bad_id_entry)
    job = await asyncio.to_thread(wait_for_job, plain, derived, timeout_s=30)
    assert job["status"] == "failed" and "job_id" in json.loads(job["errors"])[0]["message"]
    # The same job_id twice: the second entry is refused, the first runs.
    plain.xadd("tf:batch:in", {"job_id": "twice", "lines": "\n".join(good)})
    second = plain.xadd("tf:batch:in", {"job_id": "twice", "lines": "\n".join(good)}).decode()
    assert (await asyncio.to_thread(wait_for_job, plain, "twice"))["status"] == "completed"
    refused = await asyncio.to_thread(wait_for_job, plain, await asyncio.to_thread(_entry_job, plain, second))
    assert refused["status"] == "failed" and "already taken" in refused["errors"]
    # Duplicate custom_ids: the later line is refused, the earlier one runs.
    line = json.loads(good[0])
    plain.xadd("tf:batch:in", {"job_id": "dups", "lines": "\n".join([json.dumps(line)] * 2)})
    assert (await asyncio.to_thread(wait_for_job, plain, "dups"))["status"] == "completed"
    outputs = sorted(read_outputs(plain, "dups"), key=lambda o: o["index"])
    assert [o["ok"] for o in outputs] == [True, False]
    assert outputs[1]["line"]["response"]["body"]["error"]["code"] == "duplicate_custom_id"


def _entry_job(client: redis.Redis, entry_id: str, timeout_s: float = 30) -> str:
    """The id of the job an entry of tf:batch:in became (what a plain client looks up)."""
    deadline = time.monotonic() + timeout_s
    while (job_id := client.get(f"tf:batch:entry:{entry_id}")) is None:
        assert time.monotonic() < deadline, f"entry {entry_id} never became a job"
        time.sleep(0.1)
    return job_id.decode()


@pytest.mark.asyncio
async def test_cli_submit_waits_with_a_progress_bar_and_writes_the_results(scheduler, gateway, plain,
                                                                           module_redis, tmp_path):
    lines, broken = job_lines(200)
    source = tmp_path / "job.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "tokenfleet.cli", "batch"]
    url = ["--redis-url", module_redis.url]
    submit = [*cli, "submit", str(source), "--wait", "--output", str(out), "--job-id", "cli-1", *url]
    done = await asyncio.to_thread(subprocess.run, submit,
                                   cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cli-1"
    assert "200/200" in done.stderr and "completed" in done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 200
    status = await asyncio.to_thread(subprocess.run, [*cli, "status", "cli-1", *url],
                                     cwd=REPO, capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["request_counts"] == {"total": 200, "completed": 200 - len(broken),
                                                           "failed": len(broken)}
    missing = await asyncio.to_thread(subprocess.run, [*cli, "status", "nope", *url],
                                      cwd=REPO, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no batch job 'nope'" in missing.stderr


# -- crash safety: a Redis of their own; schedulers and ingesters as processes that get killed --------

# A job that is a quarter (or 30%) written when its scheduler (or ingester) is killed: 400 lines
# hold four bad ones, and keep both schedulers' 64 slots full.
KILL_JOB_LINES = 400
KILL_JOB_TOKENS = 16


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.asyncio
async def test_a_scheduler_killed_mid_job_and_the_job_completes_exactly_once(redis_server, tiny_chat,
                                                                             aiohttp_client):
    client = redis.Redis.from_url(redis_server.url)
    settings = GatewaySettings(redis_url=redis_server.url, models=[ModelSpec.from_path(str(tiny_chat))],
                               batch_lease_s=2.0)
    await aiohttp_client(create_app(settings))  # its ingester feeds and collects
    schedulers = [spawn_scheduler(redis_server.url, tiny_chat, f"s{i}") for i in range(2)]
    try:
        lines, broken = job_lines(KILL_JOB_LINES, max_tokens=KILL_JOB_TOKENS)
        client.xadd("tf:batch:in", {"job_id": "crash-1", "lines": "\n".join(lines)})
        await asyncio.to_thread(wait_written, client, "crash-1", KILL_JOB_LINES // 4, 240)
        taken = client.xpending_range(Keys().request_stream("tiny-chat", "batch"), "schedulers", "-", "+",
                                      KILL_JOB_LINES, consumername="s0")
        assert taken, "the scheduler to be killed holds no work"
        _kill(schedulers[0])
        job = await asyncio.to_thread(wait_for_job, client, "crash-1", timeout_s=240)
        assert job["status"] == "completed", job
        check_exactly_once(read_outputs(client, "crash-1"), KILL_JOB_LINES, broken,
                           max_tokens=KILL_JOB_TOKENS)
        assert int(job["failed"]) == len(broken)
    finally:
        for process in schedulers:
            _kill(process)


@pytest.mark.asyncio
async def test_an_ingester_killed_mid_job_and_a_new_one_finishes_it_exactly_once(redis_server, tiny_chat):
    client = redis.Redis.from_url(redis_server.url)
    scheduler = thread_scheduler(redis_server.url, tiny_chat)
    first = spawn_ingester(redis_server.url, tiny_chat)
    second = None
    try:
        lines, broken = job_lines(KILL_JOB_LINES, max_tokens=KILL_JOB_TOKENS)
        client.xadd("tf:batch:in", {"job_id": "crash-2", "lines": "\n".join(lines)})
        await asyncio.to_thread(wait_written, client, "crash-2", KILL_JOB_LINES * 3 // 10, 240)
        _kill(first)
        second = spawn_ingester(redis_server.url, tiny_chat)
        job = await asyncio.to_thread(wait_for_job, client, "crash-2", timeout_s=240)
        assert job["status"] == "completed", job
        check_exactly_once(read_outputs(client, "crash-2"), KILL_JOB_LINES, broken,
                           max_tokens=KILL_JOB_TOKENS)
    finally:
        for process in (first, second):
            if process is not None:
                _kill(process)
        scheduler.close()


NUM_BIG = 200_000  # lines: an intake of a few seconds here, ten times the lease


@pytest.mark.asyncio
async def test_an_intake_longer_than_the_lease_is_not_done_twice(redis_server, tiny_chat):
    """Two ingesters, a 0.3 s lease and a job whose intake takes seconds: the one taking it in
    keeps its claim, so the other never starts a second intake (which would interleave the
    staged lines). Every line is staged once, in order. No scheduler: nothing runs."""
    import redis.asyncio as aioredis

    from gateway.api.batch.ingester import BatchIngester
    from gateway.api.batch.lines import LineItem
    from gateway.tokens.models import ModelRegistry

    settings = GatewaySettings(redis_url=redis_server.url, models=[ModelSpec.from_path(str(tiny_chat))],
                               batch_lease_s=0.3, batch_max_inflight=1)
    models = ModelRegistry.load(settings.models)
    # Staging 200k lines keeps Redis busy; on a loaded machine a reply can take longer than
    # redis-py's 5 s default read timeout (the ingesters ride that out; this test's reads wait).
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=60)
    stop = asyncio.Event()
    ingesters = [BatchIngester(client, Keys(), models, settings, consumer=f"i{i}") for i in range(2)]
    tasks = [asyncio.create_task(ingester.run(stop)) for ingester in ingesters]
    try:
        lines, _ = job_lines(NUM_BIG, bad=False)
        await client.xadd("tf:batch:in", {"job_id": "big", "lines": "\n".join(lines)})
        deadline = time.monotonic() + 120
        while await client.hget(Keys().batch_job("big"), "status") != b"in_progress":
            assert time.monotonic() < deadline, await client.hgetall(Keys().batch_job("big"))
            await asyncio.sleep(0.1)
        # The job and its staged lines read in one MULTI: a feeder moves lines from the list to
        # the stream (and next_index on) meanwhile, atomically, so only one snapshot agrees.
        pipe = client.pipeline(transaction=True)
        pipe.hgetall(Keys().batch_job("big"))
        pipe.lrange(Keys().batch_lines("big"), 0, -1)
        fields, raw_lines = await pipe.execute()
        job = {k.decode(): v.decode() for k, v in fields.items()}
        # The intake really outlasted the lease (else this test would show nothing).
        assert float(job["in_progress_at"]) - float(job["created_at"]) > 3 * settings.batch_lease_s
        staged = [LineItem.unpack(raw).index for raw in raw_lines]
        assert int(job["total"]) == NUM_BIG
        assert staged == list(range(int(job["next_index"]), NUM_BIG)), "a line staged twice or missing"
        assert await client.xlen("tf:batch:in") == 0
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()


@pytest.mark.asyncio
async def test_batch_lines_score_prompts_as_the_completions_route_does(scheduler, gateway, plain):
    """Echo with logprobs (max_tokens 0 included) and vLLM's prompt_logprobs in batch lines: each
    line's body is what /v1/completions answers for the same body (greedy, same model)."""
    bodies = [{"model": TINY_CHAT, "prompt": "The quick brown fox", "max_tokens": 0, "echo": True,
               "logprobs": 2},
              {"model": TINY_CHAT, "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0, "echo": True,
               "logprobs": 1, "prompt_logprobs": 1}]
    lines = [json.dumps({"custom_id": f"score-{i}", "method": "POST", "url": "/v1/completions", "body": body})
             for i, body in enumerate(bodies)]
    sdk = openai.AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        uploaded = await sdk.files.create(file=("score.jsonl", "\n".join(lines).encode()), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                         completion_window="24h")
        deadline = time.monotonic() + 180
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.3)
            batch = await sdk.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        outputs = {o["custom_id"]: o["response"]["body"] for o in
                   map(json.loads, (await sdk.files.content(batch.output_file_id)).text.splitlines())}
    finally:
        await sdk.close()
    for i, body in enumerate(bodies):
        direct = await (await gateway.post("/v1/completions", json=body)).json()
        line = outputs[f"score-{i}"]
        for key in ("text", "finish_reason"):
            assert line["choices"][0][key] == direct["choices"][0][key]
        ours, theirs = line["choices"][0]["logprobs"], direct["choices"][0]["logprobs"]
        assert ours["tokens"] == theirs["tokens"] and ours["token_logprobs"][0] is None
        # (batched with other work or alone: float32 sums in another order)
        assert ours["token_logprobs"][1:] == pytest.approx(theirs["token_logprobs"][1:], rel=1e-5, abs=1e-5)
        assert line["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
        if "prompt_logprobs" in body:
            assert len(line["choices"][0]["prompt_logprobs"]) == len(body["prompt"])
