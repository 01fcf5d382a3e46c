"""A throw-away Redis Cluster on loopback: 3 masters + 3 replicas of ``redis-server`` on
free ports, each in its own directory, persistence off, formed with
``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes``.

Used by the cluster index's tests and ``kvroute bench index --cluster``.
``cluster-node-timeout`` (``node_timeout_ms``) is how long a master may not answer before
its replica takes over: short in failover tests (a killed master is replaced in a few
seconds), longer elsewhere, so that nodes starved of CPU on a busy machine are not
failed over by mistake.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from stack.procs import LOOPBACK, Proc, free_port, redis_command

__all__ = ["RedisCluster", "private_redis_cluster", "wait_replicas_synced"]

NODE_TIMEOUT_MS = 5000


@dataclass
class RedisCluster:
    """The running nodes (``nodes[:masters]`` were created as masters) and the URL the
    router takes (``redis+cluster://h:p,h:p,...``)."""

    nodes: list[Proc]
    masters: int
    workdir: Path
    extra: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{LOOPBACK}:{p.port}" for p in self.nodes)

    def master_of(self, key: str) -> Proc:
        """The node now serving ``key``'s slot as master (asked of a live node)."""
        import redis

        for p in self.nodes:
            if p.proc is None or p.proc.poll() is not None:
                continue
            try:
                r = redis.Redis(host=LOOPBACK, port=p.port, socket_timeout=2)
                slot = int(r.execute_command("CLUSTER", "KEYSLOT", key))
                for lo, hi, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                    if lo <= slot <= hi:
                        port = int(master[1])
                        return next(q for q in self.nodes if q.port == port)
            except redis.RedisError:
                continue
        raise RuntimeError("no live cluster node answers")

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and every slot is served by
        a live master (bounded by ``timeout``)."""
        import redis

        deadline = time.monotonic() + timeout
        while True:
            ok = True
            live = [p for p in self.nodes if p.proc is not None and p.proc.poll() is None]
            for p in live:
                try:
                    info = redis.Redis(
                        host=LOOPBACK, port=p.port, socket_timeout=2
                    ).execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    ok = ok and "cluster_state:ok" in text
                except redis.RedisError:
                    ok = False
            if ok and _slots_on_live_masters(live):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not become healthy")
            time.sleep(0.05)


def _slots_on_live_masters(live: list[Proc]) -> bool:
    import redis

    ports = {p.port for p in live}
    try:
        r = redis.Redis(host=LOOPBACK, port=live[0].port, socket_timeout=2)
        covered = 0
        for lo, hi, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
            if int(master[1]) not in ports:
                return False
            covered += hi - lo + 1
        return covered == 16384
    except (redis.RedisError, IndexError):
        return False


@contextlib.contextmanager
def private_redis_cluster(
    masters: int = 3, replicas: int = 1, node_timeout_ms: int = NODE_TIMEOUT_MS
) -> Iterator[RedisCluster]:
    """Start ``masters * (1 + replicas)`` nodes, form the cluster, wait until it serves
    every slot; stop every node and remove the directory on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-cluster-"))
    nodes: list[Proc] = []
    try:
        for _ in range(masters * (1 + replicas)):
            port = free_port()
            d = workdir / str(port)
            d.mkdir()
            cmd = [
                *redis_command(port, d),
                "--cluster-enabled", "yes",
                "--cluster-port", str(free_port()),  # the bus: any free port (not port+10000)
                "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-replica-validity-factor", "0",
                # The other shards keep serving while one fails over (as a deployment
                # that wants routing through a failover must configure it).
                "--cluster-require-full-coverage", "no",
                "--cluster-allow-reads-when-down", "yes",
            ]  # fmt: skip
            p = Proc(f"redis-{port}", cmd, port, d / "redis.log", health_path=None)
            nodes.append(p.launch())
        for p in nodes:
            p.wait_ready(15)
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        subprocess.run(
            [cli, "--cluster", "create", *(f"{LOOPBACK}:{p.port}" for p in nodes),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        cluster = RedisCluster(nodes, masters, workdir)
        cluster.wait_healthy()
        wait_replicas_synced(nodes, masters * replicas)
        yield cluster
    finally:
        for p in reversed(nodes):
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def wait_replicas_synced(nodes: list[Proc], expected: int, timeout: float = 30.0) -> None:
    """Until ``expected`` replicas report their link to the master up (a replica that
    never synced cannot take over)."""
    import redis

    deadline = time.monotonic() + timeout
    while True:
        up = 0
        for p in nodes:
            with contextlib.suppress(redis.RedisError):
                info = redis.Redis(host=LOOPBACK, port=p.port, socket_timeout=2).info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    up += 1
        if up >= expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {up} of {expected} replicas synced")
        time.sleep(0.05)
