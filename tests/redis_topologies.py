"""Real Redis Cluster and Sentinel deployments for tests: redis-server processes on 127.0.0.1, on free
ports, in a temporary directory, always stopped.

* `start_cluster(directory)`: three primaries with cluster mode on (`--cluster-port` set explicitly, so
  the bus port is a free port too), joined by `redis-cli --cluster create … --cluster-replicas 0`, ready
  when every node's `CLUSTER INFO` says `cluster_state:ok`.
* `start_sentinel(directory)`: a master, a replica of it, and one sentinel that monitors the master as
  `service_name` (default `redismaster`, LMCache's default when `REDIS_SERVICE_NAME` is unset), with a
  quorum of 1; ready when the sentinel names the master and knows the replica.

Both return an object whose `stop()` stops every process it started (also when starting fails
half-way), and module-scoped pytest fixtures `redis_cluster` and `redis_sentinel` wrap them.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import free_port, start_process, stop_process, wait_until

DEFAULT_SERVICE_NAME = "redismaster"


def redis_binary(name: str = "redis-server") -> str:
    found = shutil.which(name)
    assert found, f"{name} is missing: install the Debian redis package (scripts/setup)"
    return found


def _node_argv(port: int, directory: Path, *extra: str) -> list[str]:
    return [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(directory), *extra]


@dataclass
class Processes:
    """Processes started for one deployment, by role; `stop()` stops them all (idempotent)."""

    directory: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, role: str, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.directory / f"{role}.log"
        self.procs[role] = start_process(argv, log)
        return self.procs[role], log

    def stop(self, role: str | None = None) -> None:
        for name in [role] if role else list(self.procs):
            proc = self.procs.get(name)
            if proc is not None:
                stop_process(proc, grace=5)

    def alive(self, role: str) -> bool:
        return self.procs[role].poll() is None


# -- one plain server ----------------------------------------------------------------------------------


@dataclass
class ServerDeployment:
    port: int
    processes: Processes

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def stop(self) -> None:
        self.processes.stop()


def start_server(directory: Path, *extra: str) -> ServerDeployment:
    """One plain redis-server with extra arguments (e.g. `--maxmemory 10mb --maxmemory-policy allkeys-lru`)."""
    directory.mkdir(parents=True, exist_ok=True)
    processes = Processes(directory)
    deployment = ServerDeployment(free_port(1), processes)
    try:
        proc, log = processes.start(f"server-{deployment.port}", _node_argv(deployment.port, directory, *extra))
        wait_until(lambda: deployment.client().ping(), 20, "redis-server", proc, log)
        return deployment
    except BaseException:
        processes.stop()
        raise


# -- cluster ------------------------------------------------------------------------------------------


@dataclass
class ClusterDeployment:
    ports: list[int]
    processes: Processes

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def client(self):
        """redis-py's cluster client: commands go to the node that owns the key's slot."""
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for port in self.ports])

    def node(self, port: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=port)

    def keys_per_node(self) -> dict[int, int]:
        """DBSIZE of each primary: where the names actually are."""
        return {port: self.node(port).dbsize() for port in self.ports}

    def stop(self) -> None:
        self.processes.stop()


def _cluster_ok(port: int) -> bool:
    import redis

    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=2) as client:
        info = client.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
    return (info.get("cluster_state") if isinstance(info, dict) else None) == "ok" or b"cluster_state:ok" in info


def start_cluster(directory: Path, primaries: int = 3, extra: tuple[str, ...] = ()) -> ClusterDeployment:
    """`primaries` redis-server nodes in cluster mode, joined into one cluster with no replicas."""
    directory.mkdir(parents=True, exist_ok=True)
    processes = Processes(directory)
    ports = [free_port(1) for _ in range(primaries)]
    deployment = ClusterDeployment(ports, processes)
    try:
        for port in ports:
            argv = _node_argv(port, directory, "--cluster-enabled", "yes", "--cluster-config-file",
                              str(directory / f"nodes-{port}.conf"), "--cluster-port", str(free_port(1)),
                              "--cluster-node-timeout", "5000", *extra)
            proc, log = processes.start(f"node-{port}", argv)
            wait_until(lambda port=port: deployment.node(port).ping(), 20, f"cluster node {port}", proc, log)
        create = subprocess.run([redis_binary("redis-cli"), "--cluster", "create",
                                 *(f"127.0.0.1:{port}" for port in ports), "--cluster-replicas", "0", "--cluster-yes"],
                                check=False, capture_output=True, text=True, timeout=60)
        assert create.returncode == 0, f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}"
        for port in ports:
            wait_until(lambda port=port: _cluster_ok(port), 30, f"cluster_state:ok on {port}")
        return deployment
    except BaseException:
        processes.stop()
        raise


# -- sentinel -----------------------------------------------------------------------------------------


@dataclass
class SentinelDeployment:
    master_port: int
    replica_port: int
    sentinel_port: int
    service_name: str
    processes: Processes

    @property
    def url(self) -> str:
        """The URL LMCache takes: sentinels only (LMCache reads the service name from REDIS_SERVICE_NAME)."""
        return f"redis-sentinel://127.0.0.1:{self.sentinel_port}"

    def sentinel(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.sentinel_port, decode_responses=True)

    def master_address(self) -> tuple[str, int]:
        host, port = self.sentinel().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service_name)
        return host, int(port)

    def replica_ready(self) -> bool:
        """Whether the sentinel knows a replica it could promote (connected, its link to the master up)."""
        replicas = self.sentinel().execute_command("SENTINEL", "REPLICAS", self.service_name)
        return any(entry["flags"] == "slave" and entry["master-link-status"] == "ok" for entry in replicas)

    def client(self):
        """The current master, as the sentinel names it."""
        import redis

        host, port = self.master_address()
        return redis.Redis(host=host, port=port)

    def stop_master(self) -> None:
        """Stop whichever of the two data nodes is the master now."""
        _, port = self.master_address()
        self.processes.stop("master" if port == self.master_port else "replica")

    def stop(self) -> None:
        self.processes.stop()


def start_sentinel(directory: Path, service_name: str = DEFAULT_SERVICE_NAME,
                   down_after_ms: int = 60_000, extra: tuple[str, ...] = ()) -> SentinelDeployment:
    """A master, one replica, and one sentinel monitoring the master as `service_name` (quorum 1).

    `down_after_ms` is long by default so that stopping the master leaves it down (no automatic failover
    during a test); `SENTINEL FAILOVER` still promotes the replica on demand."""
    import redis

    directory.mkdir(parents=True, exist_ok=True)
    processes = Processes(directory)
    master_port, replica_port, sentinel_port = free_port(1), free_port(1), free_port(1)
    deployment = SentinelDeployment(master_port, replica_port, sentinel_port, service_name, processes)
    try:
        proc, log = processes.start("master", _node_argv(master_port, directory, "--dbfilename", "master.rdb", *extra))
        wait_until(lambda: redis.Redis(port=master_port).ping(), 20, "sentinel master", proc, log)
        proc, log = processes.start("replica", _node_argv(replica_port, directory, "--dbfilename", "replica.rdb",
                                                          "--replicaof", "127.0.0.1", str(master_port), *extra))
        wait_until(lambda: redis.Redis(port=replica_port).info("replication")["master_link_status"] == "up", 30,
                   "replica in sync", proc, log)
        config = directory / f"sentinel-{sentinel_port}.conf"  # sentinel rewrites its config: one of its own
        config.write_text(f"port {sentinel_port}\nbind 127.0.0.1\ndir {directory}\n"
                          f"sentinel monitor {service_name} 127.0.0.1 {master_port} 1\n"
                          f"sentinel down-after-milliseconds {service_name} {down_after_ms}\n"
                          f"sentinel failover-timeout {service_name} 10000\n")
        proc, log = processes.start("sentinel", [redis_binary(), str(config), "--sentinel"])
        wait_until(lambda: deployment.master_address() == ("127.0.0.1", master_port), 20, "sentinel", proc, log)
        wait_until(deployment.replica_ready, 30, "sentinel sees the replica in sync", proc, log)
        return deployment
    except BaseException:
        processes.stop()
        raise


def failover(deployment: SentinelDeployment, timeout: float = 30) -> tuple[str, int]:
    """Promote the replica through the sentinel (`SENTINEL FAILOVER`) and wait until the failover is over:
    the sentinel's own state (SENTINEL MASTER, which redis-py's master discovery reads; it switches later
    than GET-MASTER-ADDR-BY-NAME) names the replica, with no failover in progress, and it runs as master."""
    import redis

    old = deployment.master_address()
    deployment.sentinel().execute_command("SENTINEL", "FAILOVER", deployment.service_name)

    def promoted():
        state = deployment.sentinel().sentinel_master(deployment.service_name)
        address = (state["ip"], int(state["port"]))
        if address == old or "failover" in str(state["flags"]) or state.get("is_disconnected"):
            return None
        role = redis.Redis(host=address[0], port=address[1]).info("replication")["role"]
        return address if role == "master" else None

    return wait_until(promoted, timeout, "sentinel failover")


# -- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    deployment = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def redis_sentinel(tmp_path_factory):
    deployment = start_sentinel(tmp_path_factory.mktemp("redis-sentinel"))
    yield deployment
    deployment.stop()
