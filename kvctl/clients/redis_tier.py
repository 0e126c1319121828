"""The Redis tier, read directly: which keys exist (batched EXISTS), and listing (SCAN).

Presence checks never GET a value and never use KEYS. For plain and TLS Redis, kvctl speaks RESP
on its own socket: one pipelined write of N EXISTS commands, and N fixed-size integer replies
(`:0\\r\\n` / `:1\\r\\n`) read back in bulk, which is several times faster than a generic client.
Sentinel and cluster deployments go through redis-py.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvctl.core.errors import RejectedError, ServerError, UnreachableError
from kvctl.core.tiers import RedisURL

BATCH = 4096
SCAN_COUNT = 10_000  # keys the server looks at per SCAN call: fewer round trips, each still short
TIMEOUT_S = 5.0


def _command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)


def _commands(verb: str, groups: Sequence[Sequence[str]]) -> bytes:
    """`verb group…` per group, pipelined; built as one string (ASCII names, the usual case) because that
    is 4x faster than encoding each part."""
    if all(name.isascii() for group in groups for name in group):
        head = f"${len(verb)}\r\n{verb}\r\n"
        return "".join([f"*{len(group) + 1}\r\n{head}" + "".join([f"${len(name)}\r\n{name}\r\n" for name in group])
                        for group in groups]).encode()
    return b"".join(_command(verb.encode(), *(name.encode() for name in group)) for group in groups)


class RedisTier:
    def __init__(self, url: RedisURL, list_pattern: str = "*", timeout: float = TIMEOUT_S) -> None:
        self.url = url
        self.list_pattern = list_pattern
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buffer = b""

    # -- connection --------------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        host, port = self.url.hosts[0]
        where = f"Redis at {host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout)
        except OSError as error:
            raise UnreachableError(f"cannot connect to {where}: {error.strerror or error}",
                                   hint="check that redis-server runs and the URL in the config is right") from None
        if self.url.tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        self._sock = sock
        if self.url.password is not None:
            auth = [b"AUTH", self.url.password.encode()]
            if self.url.username:
                auth.insert(1, self.url.username.encode())
            self._simple(_command(*auth), where)
        if self.url.db:
            self._simple(_command(b"SELECT", str(self.url.db).encode()), where)
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def _receive(self) -> None:
        try:
            data = self._sock.recv(1 << 20)
        except TimeoutError:
            raise UnreachableError(f"Redis did not answer within {self.timeout:.0f} s",
                                   hint="check the server's load, or raise the timeout") from None
        if not data:
            raise UnreachableError("Redis closed the connection", hint="check the server's log")
        self._buffer += data

    def _read(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._receive()
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def _line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            self._receive()
        line, _, self._buffer = self._buffer.partition(b"\r\n")
        return line

    def _simple(self, command: bytes, where: str) -> bytes:
        self._sock.sendall(command)
        line = self._line()
        if line.startswith(b"-"):
            raise self._error(line, where)
        return line

    @staticmethod
    def _error(line: bytes, where: str) -> Exception:
        message = line[1:].decode(errors="replace")
        if "NOAUTH" in message or "WRONGPASS" in message or "invalid password" in message.lower():
            return RejectedError(f"{where} refused the credentials: {message}",
                                 hint="check the user and password in the Redis URL")
        return ServerError(f"{where} answered: {message}", hint="check the Redis URL and the server's log")

    # -- presence ------------------------------------------------------------------------------

    def exists(self, names: Sequence[str]) -> list[bool]:
        """For each key name, whether it exists; one round trip per BATCH names."""
        if self.url.scheme in ("redis-sentinel", "redis-cluster"):
            return [bool(count) for count in self._per_name("exists", names)]
        return [count == 1 for count in self._small_integers([(name,) for name in names],
                                                             lambda batch: _commands("EXISTS", batch))]

    def unlink_groups(self, groups: Sequence[Sequence[str]]) -> list[int]:
        """UNLINK each group of names (one chunk's); per group, how many names Redis removed. A cluster
        keeps a chunk's names in different slots: there each name goes on its own, pipelined."""
        if self.url.scheme in ("redis-sentinel", "redis-cluster"):
            replies = iter(self._per_name("unlink", [name for group in groups for name in group]))
            return [sum(next(replies) for _ in group) for group in groups]
        return self._small_integers(groups, lambda batch: _commands("UNLINK", batch))

    def _small_integers(self, groups: Sequence[Sequence[str]], encode) -> list[int]:
        """Send `encode(batch)` (one command per group, each answered by an integer 0-9), BATCH groups per
        round trip on kvctl's own socket, and read the fixed-size replies (`:n\\r\\n`) back in bulk."""
        sock = self._connect()
        counts: list[int] = []
        for offset in range(0, len(groups), BATCH):
            batch = groups[offset:offset + BATCH]
            sock.sendall(encode(batch))
            if self._read(1) == b"-":
                raise self._error(b"-" + self._line(), f"Redis at {self.url.hosts[0][0]}:{self.url.hosts[0][1]}")
            replies = b":" + self._read(4 * len(batch) - 1)
            if replies[0::4] != b":" * len(batch) or replies[2::4] != b"\r" * len(batch):
                raise ServerError("Redis answered with something else than small integers",
                                  hint="check that the URL points at a Redis server")
            counts.extend(digit - ord("0") for digit in replies[1::4])
        return counts

    def stored_names(self, limit: int) -> list[str]:
        return self.scan(self.list_pattern, limit)

    def scan(self, match: str, limit: int) -> list[str]:
        """Up to `limit` key names matching the glob, by SCAN (never KEYS)."""
        with self._session() as client:
            names = []
            for name in client.scan_iter(match=match, count=SCAN_COUNT):
                if len(names) == limit:
                    break
                names.append(name.decode(errors="replace") if isinstance(name, bytes) else name)
            return names

    def memory(self) -> dict:
        """The server's INFO memory section (used_memory, maxmemory, maxmemory_policy, …)."""
        with self._session() as client:
            return client.info("memory")

    def value_sizes(self, names: Sequence[str]) -> list[int]:
        """STRLEN of each name (0 when missing), pipelined: sizes without reading a value."""
        return self._per_name("strlen", names)

    # -- redis-py for sentinel / cluster and for listing -------------------------------------

    def _redis_py(self):
        import redis
        from redis.cluster import ClusterNode, RedisCluster
        from redis.sentinel import Sentinel

        common = {"username": self.url.username, "password": self.url.password, "socket_timeout": self.timeout,
                  "socket_connect_timeout": self.timeout}
        if self.url.scheme == "redis-cluster":
            return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in self.url.hosts], **common)
        if self.url.scheme == "redis-sentinel":
            sentinel = Sentinel(list(self.url.hosts), socket_timeout=self.timeout)
            return sentinel.master_for(self.url.service_name or "redismaster", **common)
        host, port = self.url.hosts[0]
        return redis.Redis(host=host, port=port, db=self.url.db, ssl=self.url.tls, **common)

    @contextmanager
    def _session(self) -> Iterator:
        """A redis-py client for one operation, closed after it; redis-py's errors become kvctl's."""
        client = self._redis_py()
        try:
            yield client
        except Exception as error:  # noqa: BLE001 - redis-py's exceptions, mapped to kvctl's
            raise _map_redis_error(error) from None
        finally:
            client.close()

    def _per_name(self, command: str, names: Sequence[str]) -> list:
        """The replies to `command name` for each name, pipelined BATCH at a time."""
        with self._session() as client:
            replies = []
            for offset in range(0, len(names), BATCH):
                pipe = client.pipeline(transaction=False)
                for name in names[offset:offset + BATCH]:
                    getattr(pipe, command)(name)
                replies.extend(pipe.execute())
            return replies



def _map_redis_error(error: Exception):
    import redis

    if isinstance(error, redis.AuthenticationError | redis.exceptions.NoPermissionError):
        return RejectedError(f"Redis refused the credentials: {error}", hint="check the user and password in the Redis URL")
    if isinstance(error, redis.ConnectionError | redis.TimeoutError):
        return UnreachableError(f"cannot reach Redis: {error}", hint="check that redis-server runs and the URL is right")
    return ServerError(f"Redis error: {error}", hint="check the server's log")
