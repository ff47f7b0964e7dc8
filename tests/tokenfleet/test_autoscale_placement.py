"""Replicas placed by Ray across nodes: two Ray nodes on this machine with one CPU each, and
`tokenfleet autoscale` wanting three replicas of one rank each. The first replica fills one
node, the second is placed on the other, the third cannot be placed: it is reported
(tf:replicas:{model} and the log) within the placement timeout, not awaited forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from protocol import registry
from shared.net import free_port
from shared.sampling import SamplingParams
from tests.scheduler.service_client import KEYS, submit, wait_terminal

pytestmark = pytest.mark.slow
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
MODEL = "tiny"


def _stop(nodes: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Each `ray start --block` process and everything it started (its own session); no global
    `ray stop`. All are asked at once, then killed after `grace_s` (a node whose head is gone
    can wait for it much longer than that)."""
    for process in nodes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in nodes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


@pytest.fixture
def two_ray_nodes():
    """(address, env): a head and a second node ("node2" resource), one CPU each, own temp dir."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}
    temp_dir = tempfile.mkdtemp(prefix="tfray", dir="/tmp")  # short: Ray's socket paths must fit
    common = ["--block", "--num-cpus=1", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    nodes = [subprocess.Popen([*RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
                               f"--temp-dir={temp_dir}", *common], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True, env=env)]
    try:
        _wait_for_status(address, env, "CPU")
        nodes.append(subprocess.Popen([*RAY, "start", f"--address={address}", '--resources={"node2": 1}',
                                       *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True, env=env))
        _wait_for_status(address, env, "node2")
        yield address, env
    finally:
        _stop(list(reversed(nodes)))


def _wait_for_status(address: str, env: dict, needle: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status = subprocess.run([*RAY, "status", f"--address={address}"], capture_output=True, text=True,
                                timeout=60, env=env)
        if status.returncode == 0 and needle in status.stdout:
            return
        time.sleep(1)
    raise AssertionError(f"the Ray cluster at {address} never showed {needle!r}")


PLACEMENT_QUERY = """
import json, sys, ray
from ray.util.placement_group import get_placement_group, placement_group_table
ray.init(address=sys.argv[1], namespace="tokenfleet", log_to_driver=False)
node2 = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node2" in n["Resources"]]
groups = {}
for name in sys.argv[2:]:
    try:
        groups[name] = list(placement_group_table(get_placement_group(name))["bundles_to_node_id"].values())
    except ValueError:
        groups[name] = None
print(json.dumps({"node2": node2, "groups": groups}))
"""


def _placements(address: str, env: dict, names: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PLACEMENT_QUERY, address, *names], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_replica_goes_to_the_node_with_room_and_a_third_is_reported_unplaced(
        two_ray_nodes, redis_server, tiny_chat, tmp_path):
    address, env = two_ray_nodes
    model = tiny_chat
    client = redis_server.client()
    log_path = tmp_path / "autoscale.log"
    with open(log_path, "wb") as log:
        autoscale = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.cli", "autoscale", "--redis-url", redis_server.url,
             "--ray-address", address, "--model", str(model), "--model-name", MODEL, "--executor", "ray",
             "--min-replicas", "3", "--max-replicas", "3", "--placement-timeout-s", "5",
             "--autoscale-interval-s", "0.5", "--",
             "--dtype", "float32", "--num-kv-blocks", "64", "--max-num-seqs", "2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**env, "TOKENFLEET_HOME": str(tmp_path / "home"), "TOKENFLEET_LOG_LEVEL": "INFO"},
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            replicas = {k.decode(): v.decode() for k, v in client.hgetall(KEYS.replicas(MODEL)).items()}
            if int(replicas.get("unplaced", 0)) >= 1 and replicas.get("actual") == "2":
                break
            assert autoscale.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, (replicas, log_path.read_text()[-3000:])
            time.sleep(0.5)
        assert replicas["desired"] == "3" and replicas["min"] == "3"  # wanted, not placed: visible
        assert sorted(registry.read_live(client, KEYS, [registry.SCHEDULERS])[registry.SCHEDULERS]) == \
            ["tiny-r0", "tiny-r1"]
        names = [f"tokenfleet-replica-tiny-r{i}" for i in range(3)]
        placed = _placements(address, env, names)
        [node2] = placed["node2"]
        [[first], [second]] = placed["groups"][names[0]], placed["groups"][names[1]]
        # one replica per node: the second went to the node that still had room
        assert first != second and node2 in (first, second)
        assert placed["groups"][names[2]] is None  # the unplaced one's request was withdrawn
        # Both serve: requests through the stream complete.
        prompt = list(range(10, 30))
        ids = [submit(client, MODEL, prompt, SamplingParams(temperature=0.0, max_tokens=8)) for _ in range(4)]
        records = wait_terminal(client, ids, timeout_s=300)
        assert {r[b"state"] for r in records.values()} == {b"completed"}
    finally:
        autoscale.send_signal(signal.SIGTERM)
        code = autoscale.wait(timeout=120)
    assert code == 0
    text = log_path.read_text()
    assert "replica_unplaced" in text and "could not place replica tiny-r2" in text
    # stopped: its replicas' groups are released
    assert _placements(address, env, names[:2])["groups"] == {names[0]: None, names[1]: None}
