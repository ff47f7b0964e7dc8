"""Seeing a real fleet: `tokenfleet up --replicas 2` (real Redis, two scheduler processes, a
gateway) on a tiny random Llama with SmolLM2's tokenizer (a step costs milliseconds), then
its engine metrics after a load, `tokenfleet status --json` with a batch job, and the status
page in a real headless Chromium.

One fleet serves the module; each test measures what its own traffic changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from protocol.prefix_hash import SUMMARY_HASH_BYTES, block_hashes, summary_hash
from scheduler.block_manager import SUMMARY_DEPTH_BLOCKS
from shared.net import free_port
from tests.fleet_helpers import KEYS, UpProcess

pytestmark = pytest.mark.slow

NUM_REQUESTS = 6
MAX_TOKENS = 120  # long enough for several heartbeats (0.25 s) to see the load


class TwoSchedulerFleet:
    def __init__(self, model: Path, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model.name
        self.home = home
        # Every flag also reads TOKENFLEET_<FLAG>: the schedulers beat (and publish their
        # metrics) every 0.25 s and log their throughput every second; a lease long enough that a
        # machine busy with other work never has one scheduler take the other's requests.
        self.up = UpProcess(["--port", str(self.port), "--model", str(model), "--replicas", "2",
                             "--num-kv-blocks", "128", "--dtype", "float32", "--gateway-workers", "1"],
                            home, TOKENFLEET_HEARTBEAT_S="0.25", TOKENFLEET_LOG_STATS_INTERVAL_S="1",
                            TOKENFLEET_LEASE_S="120")
        self.env = self.up.env
        self.up.wait_up()
        self.redis = redis.Redis.from_url(json.loads((home / "fleet.json").read_text())["redis_url"])
        deadline = time.monotonic() + 300
        self.scheduler_ids = [f"{self.model}-0", f"{self.model}-1"]
        while set(_kv(self.engine_samples())) != set(self.scheduler_ids):  # /ready needs only one
            assert time.monotonic() < deadline, "both schedulers never reported"
            time.sleep(0.1)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr
        return done

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.read()

    def post(self, path: str, body: dict) -> bytes:
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read()

    def chat(self, content: str, max_tokens: int = MAX_TOKENS) -> dict:
        body = json.dumps({"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "messages": [{"role": "user", "content": content}]}).encode()
        request = urllib.request.Request(self.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def engine_samples(self) -> dict[tuple, float]:
        """(name, scheduler, finished_reason) -> value, of the tokenfleet:* samples on /metrics."""
        text = self.get("/metrics").decode()
        return {(s.name, s.labels.get("scheduler"), s.labels.get("finished_reason")): s.value
                for family in text_string_to_metric_families(text) if family.name.startswith("tokenfleet:")
                for s in family.samples}

    def stop(self) -> None:
        self.redis.close()
        assert self.up.stop() == 0, self.up.output[-3000:]


@pytest.fixture(scope="module")
def fleet(tiny_chat, tmp_path_factory):
    fleet = TwoSchedulerFleet(tiny_chat, tmp_path_factory.mktemp("home"))
    yield fleet
    fleet.stop()


def _total(samples: dict, name: str, reason: str | None = None) -> float:
    return sum(v for (n, _, r), v in samples.items() if n == name and r == reason)


def _delta(before: dict, after: dict, name: str, reason: str | None = None) -> float:
    return _total(after, f"tokenfleet:{name}", reason) - _total(before, f"tokenfleet:{name}", reason)


def _kv(samples: dict) -> dict[str, float]:
    return {s: v for (n, s, _), v in samples.items() if n == "tokenfleet:kv_cache_usage_perc"}


def _load(fleet: TwoSchedulerFleet, num_requests: int, answers: list, max_tokens: int = MAX_TOKENS) -> list:
    """Threads, started, each sending one chat completion; their answers go to `answers`."""
    def ask(i: int) -> None:
        answers.append(fleet.chat(f"Tell me about the number {i}.", max_tokens))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(num_requests)]
    for thread in threads:
        thread.start()
    return threads


def _throughput_lines(fleet: TwoSchedulerFleet) -> list[dict]:
    return [json.loads(line) for i in range(2) for line in
            (fleet.home / "logs" / f"scheduler-{i}.log").read_text().splitlines()
            if '"engine_throughput"' in line]


def test_engine_metrics_agree_with_a_load_and_kv_use_rises_then_returns_to_zero(fleet):
    before = fleet.engine_samples()
    assert set(_kv(before)) == set(fleet.scheduler_ids)  # every scheduler reports, through the gateway
    answers: list[dict] = []
    threads = _load(fleet, NUM_REQUESTS, answers)
    peak_kv = 0.0
    while any(t.is_alive() for t in threads):
        peak_kv = max(peak_kv, sum(_kv(fleet.engine_samples()).values()))
        time.sleep(0.1)
    assert len(answers) == NUM_REQUESTS
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    completion_tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    assert completion_tokens == NUM_REQUESTS * MAX_TOKENS
    # The schedulers report at their next heartbeat: wait for it, then compare exactly.
    deadline = time.monotonic() + 30
    while True:
        after = fleet.engine_samples()
        generated = _delta(before, after, "generation_tokens_total")
        if (generated >= completion_tokens and not any(_kv(after).values())) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert peak_kv > 0, "KV use never showed above 0 during the load"
    assert _kv(after) == dict.fromkeys(fleet.scheduler_ids, 0.0)
    assert generated == completion_tokens
    assert _delta(before, after, "prompt_tokens_total") == prompt_tokens
    assert _delta(before, after, "request_success_total", "length") == NUM_REQUESTS
    for name in ("num_requests_running", "num_requests_waiting"):
        assert _total(after, f"tokenfleet:{name}") == 0
    assert _delta(before, after, "step_duration_seconds_count") >= MAX_TOKENS  # a step per token at least
    # The throughput line, with what the scheduler did: written for every window (1 s here) that
    # had work, the one in which the work ended included, so by the end of that window at the
    # latest. A load shorter than a window may end before its line is written: wait for it.
    deadline = time.monotonic() + 15
    while not (lines := _throughput_lines(fleet)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lines, "no engine_throughput line in either scheduler's log"
    assert all(line["generation_tokens_per_s"] >= 0 for line in lines)
    assert any(line["generation_tokens_per_s"] > 0 for line in lines)


@pytest.fixture(scope="module")
def batch_job(fleet, tmp_path_factory) -> str:
    """A two-line batch job, run to its end through the CLI."""
    job = tmp_path_factory.mktemp("job") / "job.jsonl"
    job.write_text("".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": fleet.model, "max_tokens": 4, "messages": [{"role": "user", "content": f"Hi {i}"}]},
    }) + "\n" for i in range(2)))
    fleet.cli("batch", "submit", str(job), "--job-id", "status-job", "--wait")
    return "status-job"


def test_status_json_shows_both_schedulers_the_queues_the_batch_job_and_the_gateway(fleet, batch_job):
    view = json.loads(fleet.cli("status", "--json").stdout)  # finds Redis in fleet.json
    assert view["totals"]["schedulers"] == 2
    assert [s["id"] for s in view["schedulers"]] == fleet.scheduler_ids
    for scheduler in view["schedulers"]:
        assert scheduler["model"] == fleet.model and scheduler["tp"] == 1
        assert scheduler["num_running"] == 0 and scheduler["kv_usage"] == 0
        assert 0 <= scheduler["heartbeat_age_s"] < 5
        assert scheduler["num_kv_blocks"] == 128
    assert sum(s["num_finished"] for s in view["schedulers"]) >= 2  # the job's lines, at least
    queues = {(q["model"], q["kind"]): q for q in view["queues"]}
    assert set(queues) == {(fleet.model, "interactive"), (fleet.model, "batch")}
    assert queues[(fleet.model, "interactive")]["consumers"] == 2
    for queue in queues.values():
        assert queue["length"] == queue["pending"] == queue["queued"] == 0  # acknowledged and deleted
    [job] = view["batch_jobs"]
    assert job["id"] == batch_job and job["model"] == fleet.model
    assert (job["status"], job["total"], job["completed"], job["failed"], job["progress"]) == \
        ("completed", 2, 2, 0, 1.0)
    assert view["dead_letters"]["count"] == 0
    assert len(view["throughput_history"]["generation_tokens"]) == 120
    assert sum(view["throughput_history"]["generation_tokens"]) > 0  # the job's and the load's tokens
    [gateway] = view["gateways"]
    assert (gateway["host"], gateway["port"], gateway["models"]) == ("127.0.0.1", fleet.port, [fleet.model])
    # The table says the same.
    table = fleet.cli("status").stdout
    for text in (*fleet.scheduler_ids, batch_job, "2/2 (100%)", f"127.0.0.1:{fleet.port}", "Dead letters: 0"):
        assert text in table, table


class _Cells(HTMLParser):
    """Text of every table row, per table id."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[list[str]]] = {}
        self.attrs: dict[str, dict] = {}
        self.text: dict[str, str] = {}  # id -> text directly inside that element
        self._current_id: str | None = None
        self._table: str | None = None
        self._in_body = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._current_id = attrs.get("id")
        if "id" in attrs:
            self.attrs[attrs["id"]] = attrs
            self.text[attrs["id"]] = ""
        if tag == "table":
            self._table = attrs.get("id")
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.setdefault(self._table, []).append([])
        elif tag == "td" and self._in_body:
            self.rows[self._table][-1].append("")

    def handle_endtag(self, tag):
        self._current_id = None
        if tag == "tbody":
            self._in_body = False

    def handle_data(self, data):
        if self._current_id is not None:
            self.text[self._current_id] += data
        if self._in_body and self._table in self.rows and self.rows[self._table][-1]:
            self.rows[self._table][-1][-1] += data


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: scripts/setup-venv installs Debian's chromium package")
        pytest.skip("no chromium on this machine (scripts/setup-venv installs it as root)")
    return path


def _chromium_args(profile: Path) -> list[str]:
    return [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900",
            # Virtual time runs the page's 1 s polls without waiting for them in real time.
            "--virtual-time-budget=6000"]


def test_status_page_in_headless_chromium_shows_the_running_fleet(fleet, batch_job, tmp_path):
    answers: list[dict] = []
    threads = _load(fleet, 4, answers, max_tokens=100)  # a fleet at work while the page polls
    try:
        dom = subprocess.run([*_chromium_args(tmp_path / "profile"), "--dump-dom", fleet.url + "/"],
                             capture_output=True, text=True, timeout=120)
        screenshot = tmp_path / "status-page.png"
        shot = subprocess.run([*_chromium_args(tmp_path / "profile"), f"--screenshot={screenshot}",
                               fleet.url + "/"], capture_output=True, text=True, timeout=120)
    finally:
        for thread in threads:
            thread.join(timeout=300)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = _Cells()
    page.feed(dom.stdout)
    schedulers = page.rows["schedulers"]
    assert [row[0] for row in schedulers] == fleet.scheduler_ids, schedulers
    assert all(row[1] == fleet.model and row[2] == "1x1" for row in schedulers), schedulers  # TP x PP
    assert all(row[5].endswith("%") for row in schedulers), schedulers  # the KV bar's label
    [job] = page.rows["jobs"]
    assert job[0] == batch_job and job[2] == "completed" and "2 / 2" in job[3], job
    [gateway] = page.rows["gateways"]
    assert gateway[1] == f"127.0.0.1:{fleet.port}", gateway
    kinds = {(row[0], row[1]) for row in page.rows["queues"]}
    assert kinds == {(fleet.model, "interactive"), (fleet.model, "batch")}
    assert page.rows["dead"] == [["none"]]
    sparkline = page.attrs["sparkline"]  # the last two minutes, drawn at the first poll
    assert int(sparkline["data-points"]) == 120 and int(sparkline["data-peak"]) > 0, sparkline
    assert page.text["updated"].startswith("updated "), page.text["updated"]  # its last poll worked
    assert shot.returncode == 0 and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]
    artifacts = os.environ.get("TOKENFLEET_TEST_ARTIFACTS")
    if artifacts:  # e.g. docs/ when refreshing the README's picture
        shutil.copy(screenshot, Path(artifacts) / "status-page.png")


def test_chats_sharing_a_system_prompt_are_routed_to_the_replica_that_cached_it(fleet):
    """The first chat goes to the shared stream (no replica holds its prefix); once a heartbeat
    has published that replica's summary and the gateway has read it, the next chats with that
    system prompt go to the same replica's own stream and find the prompt cached. The counts and
    the fleet's hit rate show in `tokenfleet status` and on /metrics."""
    system = " ".join(f"rule {i} is to be kind." for i in range(60))  # ~400 tokens

    def chat(user: str) -> dict:
        body = json.dumps({"model": fleet.model, "max_tokens": 2, "temperature": 0, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]}).encode()
        request = urllib.request.Request(fleet.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def routed() -> dict[str, int]:
        view = json.loads(fleet.cli("status", "--json").stdout)
        return {s["id"]: s["entries_routed"] for s in view["schedulers"]}

    def shared_heads() -> set[bytes]:
        """The summary hashes of the blocks every chat here shares (the system prompt's)."""
        ids = [json.loads(fleet.post("/tokenize", {"model": fleet.model, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]}))["tokens"]
            for user in ("Hello.", "Question 0?")]
        shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
        block_size = int(fleet.redis.hget(KEYS.scheduler(fleet.scheduler_ids[0]), "block_size"))
        return {summary_hash(h) for h in block_hashes(ids[0][:shared], block_size, SUMMARY_DEPTH_BLOCKS)}

    def summarized_by() -> list[str]:
        """The schedulers whose prefix summary (in Redis) names every shared block."""
        names = []
        for scheduler_id in fleet.scheduler_ids:
            blob = fleet.redis.get(KEYS.prefix_summary(scheduler_id)) or b""
            if heads <= {blob[i:i + SUMMARY_HASH_BYTES] for i in range(0, len(blob), SUMMARY_HASH_BYTES)}:
                names.append(scheduler_id)
        return names

    heads = shared_heads()
    assert len(heads) >= 16, len(heads)
    before = routed()
    first = chat("Hello.")
    # A heartbeat (0.25 s, later on a loaded machine) publishes the summary of the replica that
    # served it; then /ready makes the gateway read the fleet anew (its own refresh is every 1 s).
    deadline = time.monotonic() + 60
    while not summarized_by():
        assert time.monotonic() < deadline, "no scheduler's prefix summary names the system prompt"
        time.sleep(0.1)
    fleet.get("/ready")
    answers = [chat(f"Question {i}?") for i in range(4)]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert all(c >= first["usage"]["prompt_tokens"] - 32 for c in cached), cached
    # The counts reach `tokenfleet status` with each scheduler's next heartbeat.
    deadline = time.monotonic() + 60
    while sum((gained := {s: n - before.get(s, 0) for s, n in routed().items()}).values()) < 4:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(gained.values()) == [0, 4], gained  # all four on one replica, through its own stream
    view = json.loads(fleet.cli("status", "--json").stdout)
    assert view["totals"]["prefix_cache_hit_rate"] > 0
    assert "prefix-cache hit rate" in fleet.cli("status").stdout
    text = fleet.get("/metrics").decode()
    assert "tokenfleet_fleet_prefix_cache_hit_rate{" in text
    assert 'tokenfleet:routing_entries_total{' in text and 'source="routed"' in text
