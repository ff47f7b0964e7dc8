"""`tokenfleet up` keeps its fleet up: kill -9 of the scheduler while streams run, of the
gateway, and of Redis; each comes back, and nothing accepted is lost.

One fleet for the module, the kills in turn: a tiny random llama with SmolLM2's tokenizer
(so the gateway does its real text work while the model costs little), at TP=1, one gateway
process. Outputs are judged against the same fleet's answers before anything was killed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from shared.net import free_port
from testkit.sse import DONE, data_of
from tests.fleet_helpers import TINY_CHAT, UpProcess

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain."]
MAX_TOKENS = 24


class UpFleet:
    def __init__(self, process: subprocess.Popen, port: int, home) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.home = home

    def child(self, *words: str) -> psutil.Process:
        """The one direct child of `up` whose command line holds every word."""
        found = [p for p in psutil.Process(self.process.pid).children()
                 if all(w in " ".join(p.cmdline()) for w in words)]
        assert len(found) == 1, [p.cmdline() for p in psutil.Process(self.process.pid).children()]
        return found[0]

    def kill_9(self, *words: str) -> int:
        victim = self.child(*words)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        return victim.pid

    def wait_new_child(self, old_pid: int, *words: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, "up exited"
            try:
                if self.child(*words).pid != old_pid:
                    return
            except AssertionError:
                pass  # not restarted yet
            assert time.monotonic() < deadline, f"{words} was not restarted"
            time.sleep(0.2)

    def post(self, path: str, body: dict, timeout_s: float = 120) -> dict:
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def post_until_served(self, path: str, body: dict, timeout_s: float = 180) -> dict:
        """Retries while the front door is down or answers 5xx (a child coming back)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.post(path, body)
            except (urllib.error.URLError, ConnectionError) as exc:
                if isinstance(exc, urllib.error.HTTPError) and exc.code < 500:
                    raise
                assert time.monotonic() < deadline, f"not served within {timeout_s} s: {exc}"
                time.sleep(0.5)


def _body(question: str, **extra) -> dict:
    return {"model": TINY_CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": question}], **extra}


@pytest.fixture(scope="module")
def fleet(tiny_chat, tmp_path_factory):
    port = free_port()
    up = UpProcess(["--port", str(port), "--model", str(tiny_chat), "--num-kv-blocks", "256",
                    "--dtype", "float32", "--gateway-workers", "1"], tmp_path_factory.mktemp("up-home"))
    up.wait_up()  # up's own log (child_exited, child_restarted) goes on in the background
    yield UpFleet(up.process, port, up.home)
    assert up.stop() == 0, up.output


def _stream(fleet: UpFleet, question: str, out: dict, first_chunk: threading.Event) -> None:
    request = urllib.request.Request(fleet.url + "/v1/chat/completions",
                                     json.dumps(_body(question, stream=True)).encode(),
                                     {"Content-Type": "application/json"})
    text = []
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            for raw in response:
                data = data_of(raw)
                if data is None or data == DONE:
                    out["done"] = out.get("done", False) or data == DONE
                    continue
                delta = json.loads(data)["choices"][0]["delta"].get("content")
                if delta:
                    text.append(delta)
                    first_chunk.set()
    except Exception as exc:  # noqa: BLE001 - the test reports it
        out["error"] = repr(exc)
    out["text"] = "".join(text)


@pytest.fixture(scope="module")
def undisturbed(fleet) -> dict[str, str]:
    """question -> the answer of the fleet before anything was killed"""
    return {q: fleet.post("/v1/chat/completions", _body(q))["choices"][0]["message"]["content"]
            for q in QUESTIONS}


def test_streams_outlive_a_scheduler_killed_with_kill_9(fleet, undisturbed):
    results = {q: {} for q in QUESTIONS}
    started = {q: threading.Event() for q in QUESTIONS}
    threads = [threading.Thread(target=_stream, args=(fleet, q, results[q], started[q])) for q in QUESTIONS]
    for thread in threads:
        thread.start()
    for event in started.values():
        assert event.wait(120)
    old = fleet.kill_9(" scheduler ")
    fleet.wait_new_child(old, " scheduler ")
    for thread in threads:
        thread.join(300)
    for question in QUESTIONS:
        assert results[question].get("done"), results[question]
        assert results[question]["text"] == undisturbed[question]
    after = fleet.post_until_served("/v1/chat/completions", _body(QUESTIONS[0]))
    assert after["choices"][0]["message"]["content"] == undisturbed[QUESTIONS[0]]


def test_a_request_after_the_gateway_was_killed_is_served(fleet, undisturbed):
    old = fleet.kill_9(" gateway ")
    fleet.wait_new_child(old, " gateway ")
    answer = fleet.post_until_served("/v1/chat/completions", _body(QUESTIONS[1]))
    assert answer["choices"][0]["message"]["content"] == undisturbed[QUESTIONS[1]]


def test_redis_killed_with_kill_9_comes_back_from_its_append_only_file(fleet, undisturbed):
    """Requests accepted (202) just before Redis dies are still there, and run, after it
    comes back from its append-only file."""
    accepted = [fleet.post("/v1/requests", {"kind": "chat", **_body(q)})["id"] for q in QUESTIONS]
    old = fleet.kill_9("redis-server")
    fleet.wait_new_child(old, "redis-server")
    deadline = time.monotonic() + 600
    views = {}
    while len(views) < len(accepted):
        for req_id in accepted:
            try:
                view = fleet.get(f"/v1/requests/{req_id}")
            except (urllib.error.URLError, ConnectionError):
                continue  # Redis or the gateway's connection to it coming back
            if view["status"] not in ("queued", "running"):
                views[req_id] = view
        assert time.monotonic() < deadline, views
        time.sleep(0.5)
    assert [views[r]["status"] for r in accepted] == ["completed"] * len(accepted)
    assert [views[r]["output"]["text"] for r in accepted] == [undisturbed[q] for q in QUESTIONS]
