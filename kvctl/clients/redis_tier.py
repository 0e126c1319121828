"""The Redis tier, read directly: which keys exist (batched EXISTS), and listing (SCAN).

Presence checks never GET a value and never use KEYS. For plain and TLS Redis, kvctl speaks RESP
on its own socket: one pipelined write of N EXISTS commands, and N fixed-size integer replies
(`:0\\r\\n` / `:1\\r\\n`) read back in bulk, which is several times faster than a generic client.
Sentinel and cluster deployments go through redis-py, as LMCache's own connectors do:

* `redis-cluster://h1:p1,h2:p2`: any reachable node is enough to learn the topology; SCAN runs on every
  primary (a chunk's two names hash to different slots, so they usually live on different nodes), and
  presence checks, sizes and removals go one name per command, pipelined per node (redis-py refuses a
  multi-key command across slots).
* `redis-sentinel://h1:p1,h2:p2[/name]`: the sentinels name the current master, and kvctl reads and
  removes there. LMCache takes the service name from `REDIS_SERVICE_NAME` in the engine's environment
  (default `redismaster`) and ignores the URL's path; kvctl takes `REDIS_SERVICE_NAME` from its own
  environment first (source the configuration's env.sh), then the URL's path, then `redismaster`.
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvctl.core.errors import KvctlError, RejectedError, ServerError, UnreachableError
from kvctl.core.lmcache.tiers import RedisURL

BATCH = 4096
VALUE_BATCH = 64  # chunk values per pipelined GET: a few MiB each at most
PIPELINE_BYTES = 64 * 1024 * 1024  # bytes of values queued per pipelined SET
SERVICE_NAME_ENV = "REDIS_SERVICE_NAME"  # LMCache's sentinel connector reads the master's name from it
DEFAULT_SERVICE_NAME = "redismaster"  # … and falls back to this
SCAN_COUNT = 10_000  # keys the server looks at per SCAN call: fewer round trips, each still short
TIMEOUT_S = 5.0


def _command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(map(_bulk, parts))


def _commands(verb: str, keys: Sequence[str], suffixes: Sequence[str]) -> bytes:
    """`verb key+suffix…` for each key, pipelined, as RESP. Built by slicing into one list joined once
    (no string per command or per name): in Python the encoding is otherwise what bounds a big batch."""
    text = _resp(verb, keys, suffixes, list(map(len, keys)))
    if not text.isascii():  # RESP counts bytes: measure each name encoded
        text = _resp(verb, keys, suffixes, [len(key.encode()) for key in keys])
    return text.encode()


def _resp(verb: str, keys: Sequence[str], suffixes: Sequence[str], sizes: list[int]) -> str:
    step = 3 * len(suffixes)
    pieces = [""] * (step * len(keys))
    for index, suffix in enumerate(suffixes):
        head = f"*{len(suffixes) + 1}\r\n${len(verb)}\r\n{verb}\r\n" if index == 0 else ""
        extra = len(suffix.encode())
        headers = {size: f"{head}${size + extra}\r\n" for size in set(sizes)}
        pieces[3 * index::step] = map(headers.__getitem__, sizes)
        pieces[3 * index + 1::step] = keys
        pieces[3 * index + 2::step] = [suffix + "\r\n"] * len(keys)
    return "".join(pieces)


def _bulk(part: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(part), part)


def _not_redis() -> ServerError:
    return ServerError("Redis answered with something that is no reply to kvctl's command",
                       hint="check that the URL points at a Redis server")


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
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a batch's last segment goes at once
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
            self._sock, self._buffer = None, b""

    @contextmanager
    def _pipeline(self) -> Iterator[socket.socket]:
        """kvctl's socket for one pipelined exchange, closed if it fails part way (replies left unread)."""
        sock = self._connect()
        try:
            yield sock
        except BaseException:
            self.close()
            raise

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
        """For each key name, whether it exists (one EXISTS per name: a multi-key EXISTS only counts)."""
        if self.url.scheme in ("redis-sentinel", "redis-cluster"):
            return [bool(count) for count in self._per_name("exists", names)]
        return list(map(ord("1").__eq__, self._small_integers("EXISTS", names, ("",))))

    def unlink_each(self, keys: Sequence[str], suffixes: Sequence[str]) -> list[int]:
        """For each key, UNLINK its names (the key with each suffix: one chunk's) in one command; how many
        of them Redis removed. A cluster keeps a chunk's names in different slots: there each name goes on
        its own, pipelined."""
        if self.url.scheme in ("redis-sentinel", "redis-cluster"):
            replies = iter(self._per_name("unlink", [key + suffix for key in keys for suffix in suffixes]))
            return [sum(next(replies) for _ in suffixes) for _ in keys]
        return [digit - ord("0") for digit in self._small_integers("UNLINK", keys, suffixes)]

    def _small_integers(self, verb: str, keys: Sequence[str], suffixes: Sequence[str]) -> bytes:
        """The replies to `verb key+suffix…` for each key (each an integer 0-9), as one digit per key.
        BATCH commands per write on kvctl's own socket, the next batch sent before the replies to the
        previous one are read (Redis works while kvctl encodes), and the fixed-size replies (`:n\\r\\n`)
        read back in bulk."""
        digits, pending = [], 0
        with self._pipeline() as sock:
            for offset in range(0, len(keys), BATCH):
                batch = keys[offset:offset + BATCH]
                sock.sendall(_commands(verb, batch, suffixes))
                if pending:
                    digits.append(self._digits(pending))
                pending = len(batch)
            if pending:
                digits.append(self._digits(pending))
        return b"".join(digits)

    def _scan_cursor(self) -> bytes:
        """The cursor at the head of a SCAN reply (`*2`, then the cursor as a bulk string)."""
        line = self._line()
        if line.startswith(b"-"):
            raise self._error(line, f"Redis at {self.url.hosts[0][0]}:{self.url.hosts[0][1]}")
        size = self._line()
        if line != b"*2" or not size.startswith(b"$") or not size[1:].isdigit():
            raise _not_redis()
        return self._read(int(size[1:]) + 2)[:-2]

    def _bulk_strings(self) -> list[str]:
        """An array of bulk strings. Read by splitting the buffer at CRLF once the reply is in, checked by
        each name's announced length (a name holding a CRLF fails the check); else one by one."""
        count = self._line()
        if not count.startswith(b"*") or not count[1:].isdigit():
            raise _not_redis()
        count = int(count[1:])
        while self._buffer.count(b"\r\n") < 2 * count:
            self._receive()
        *pieces, rest = self._buffer.split(b"\r\n", 2 * count)
        names = pieces[1::2]
        if pieces[0::2] == list(map(b"$%d".__mod__, map(len, names))):
            self._buffer = rest
            return [name.decode(errors="replace") for name in names]
        return self._bulk_strings_one_by_one(count)

    def _bulk_strings_one_by_one(self, count: int) -> list[str]:
        data, position, names = self._buffer, 0, []
        for _ in range(count):
            while (end := data.find(b"\r\n", position)) < 0:
                data = self._more(data)
            size = data[position + 1:end]
            if data[position] != ord("$") or not size.isdigit():
                raise _not_redis()
            start = end + 2
            stop = start + int(size)
            while len(data) < stop + 2:
                data = self._more(data)
            names.append(data[start:stop].decode(errors="replace"))
            position = stop + 2
        self._buffer = data[position:]
        return names

    def _more(self, data: bytes) -> bytes:
        self._buffer = data
        self._receive()
        return self._buffer

    def _digits(self, count: int) -> bytes:
        """The next `count` replies, each a one-digit integer, as their digits."""
        if self._read(1) == b"-":
            raise self._error(b"-" + self._line(), f"Redis at {self.url.hosts[0][0]}:{self.url.hosts[0][1]}")
        replies = b":" + self._read(4 * count - 1)
        if replies[0::4] != b":" * count or replies[2::4] != b"\r" * count:
            raise _not_redis()
        return replies[1::4]

    def stored_names(self, limit: int) -> list[str]:
        return self.scan(self.list_pattern, limit)

    def scan(self, match: str, limit: int, pick: Callable[[list[str]], list] = list) -> list:
        """Up to `limit` of what `pick` keeps of the key names matching the glob, page by page, by SCAN
        (never KEYS). On plain Redis kvctl asks for the next page as soon as a reply's cursor is in, and
        reads and picks from the page while Redis scans on."""
        kept: list = []
        if self.url.scheme not in ("redis-sentinel", "redis-cluster"):
            pattern, count = match.encode(), b"%d" % SCAN_COUNT
            with self._pipeline() as sock:
                sock.sendall(_command(b"SCAN", b"0", b"MATCH", pattern, b"COUNT", count))
                while True:
                    cursor = self._scan_cursor()
                    going_on = cursor != b"0" and len(kept) < limit
                    if going_on:
                        sock.sendall(_command(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", count))
                    kept.extend(pick(self._bulk_strings()))
                    if not going_on:
                        return kept[:limit]
        with self._session() as client:
            names = (name.decode(errors="replace") if isinstance(name, bytes) else name
                     for name in client.scan_iter(match=match, count=SCAN_COUNT))
            while len(kept) < limit and (page := list(itertools.islice(names, SCAN_COUNT))):
                kept.extend(pick(page))
            return kept[:limit]

    def memory(self) -> dict:
        """The server's INFO memory section (used_memory, maxmemory, maxmemory_policy, …). On a cluster,
        the primaries' sections added up: memory and limits summed (maxmemory 0, no limit, when any primary
        has none), the policy named once when all agree, else the distinct policies joined by commas."""
        nodes = self.memory_by_node()
        if len(nodes) == 1:
            return next(iter(nodes.values()))
        infos = list(nodes.values())
        merged = {name: value for name, value in infos[0].items() if not name.endswith("_human")}  # one node's text
        for field in ("used_memory", "used_memory_rss", "used_memory_dataset"):
            if all(field in info for info in infos):
                merged[field] = sum(int(info[field]) for info in infos)
        limits = [int(info.get("maxmemory") or 0) for info in infos]
        merged["maxmemory"] = 0 if 0 in limits else sum(limits)
        merged["maxmemory_policy"] = ",".join(dict.fromkeys(str(info.get("maxmemory_policy")) for info in infos))
        merged["nodes"] = len(infos)
        return merged

    def memory_by_node(self) -> dict[str, dict]:
        """INFO memory of every server that holds chunks, by "host:port": each primary of a cluster,
        the master of a sentinel deployment, the one server otherwise."""
        with self._session() as client:
            if self.url.scheme == "redis-cluster":
                from redis.cluster import RedisCluster

                return dict(client.info("memory", target_nodes=RedisCluster.PRIMARIES))
            return {self._address(client): client.info("memory")}

    def eviction_risk(self) -> str | None:
        """`split_eviction_risk` of every server that holds chunks (see memory_by_node); where there are
        several (a cluster's primaries), the servers at risk are named before each distinct warning.
        None when no server is at risk."""
        nodes = self.memory_by_node()
        by_risk: dict[str, list[str]] = {}
        for node, info in nodes.items():
            if risk := split_eviction_risk(info):
                by_risk.setdefault(risk, []).append(node)
        if len(nodes) == 1:
            return next(iter(by_risk), None)
        return "; ".join(f"{', '.join(sorted(at))}: {risk}" for risk, at in by_risk.items()) or None

    def ping(self) -> str:
        """Check that every server holding chunks answers; the detail for `kvctl health`. A cluster must
        answer on each primary and report cluster_state:ok (a cluster missing a primary refuses every
        command once its nodes notice); a sentinel deployment names the master the sentinels chose."""
        if self.url.scheme not in ("redis-sentinel", "redis-cluster"):
            self.exists(["kvctl-health"])
            return "answers"
        with self._session() as client:
            if self.url.scheme == "redis-cluster":
                from redis.cluster import RedisCluster

                client.ping(target_nodes=RedisCluster.PRIMARIES)
                state = client.cluster_info()
                if state.get("cluster_state") != "ok":
                    raise UnreachableError(f"Redis Cluster state is {state.get('cluster_state')!r}, not ok",
                                           hint="a primary is down or slots are not covered: redis-cli --cluster check")
                return f"answers (cluster, {len(client.get_primaries())} primaries)"
            client.ping()
            return f"answers (master {self._address(client)} of {self.service_name()!r})"

    def service_name(self) -> str:
        """The sentinel service (master) name: REDIS_SERVICE_NAME, else the URL's path, else redismaster."""
        return os.environ.get(SERVICE_NAME_ENV) or self.url.service_name or DEFAULT_SERVICE_NAME

    def _address(self, client) -> str:
        """host:port of the server a plain or sentinel client talks to."""
        if self.url.scheme == "redis-sentinel":
            host, port = client.connection_pool.get_master_address()
            return f"{host}:{port}"
        host, port = self.url.hosts[0]
        return f"{host}:{port}"

    def get_values(self, names: Sequence[str]) -> Iterator[bytes | None]:
        """GET each name (None when missing), VALUE_BATCH per pipeline: values are whole chunks."""
        with self._session() as client:
            for offset in range(0, len(names), VALUE_BATCH):
                pipe = client.pipeline(transaction=False)
                for name in names[offset:offset + VALUE_BATCH]:
                    pipe.get(name)
                yield from pipe.execute()

    def set_values(self, items: Iterable[tuple[str, bytes | memoryview]]) -> int:
        """SET each (name, value) in order, pipelined until PIPELINE_BYTES are queued; how many were set."""
        count = 0
        with self._session() as client:
            pipe, queued = client.pipeline(transaction=False), 0
            for name, value in items:
                pipe.set(name, value)
                queued += memoryview(value).nbytes
                count += 1
                if queued >= PIPELINE_BYTES:
                    pipe.execute()
                    pipe, queued = client.pipeline(transaction=False), 0
            pipe.execute()
        return count

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
            # the sentinels themselves take no credentials (LMCache passes none to them either)
            sentinel = Sentinel(list(self.url.hosts), sentinel_kwargs={"socket_timeout": self.timeout,
                                                                       "socket_connect_timeout": self.timeout})
            return sentinel.master_for(self.service_name(), **common)
        host, port = self.url.hosts[0]
        return redis.Redis(host=host, port=port, db=self.url.db, ssl=self.url.tls, **common)

    @contextmanager
    def _session(self) -> Iterator:
        """A redis-py client for one operation, closed after it; redis-py's errors become kvctl's (also
        those of building the client: a cluster client connects to learn the topology)."""
        client = None
        try:
            client = self._redis_py()
            yield client
        except Exception as error:  # noqa: BLE001 - redis-py's exceptions, mapped to kvctl's
            raise self._map_error(error) from None
        finally:
            if client is not None:
                client.close()

    def _map_error(self, error: Exception) -> Exception:
        from redis.exceptions import ClusterDownError, RedisClusterException
        from redis.sentinel import MasterNotFoundError

        if isinstance(error, KvctlError):
            return error
        hosts = ",".join(f"{host}:{port}" for host, port in self.url.hosts)
        if isinstance(error, MasterNotFoundError):
            return UnreachableError(
                f"no Redis master {self.service_name()!r} at the sentinels {hosts}: {error}",
                hint=f"check that the sentinels run and monitor this name; LMCache reads it from {SERVICE_NAME_ENV} "
                     f"(default {DEFAULT_SERVICE_NAME}), and so does kvctl (source the configuration's env.sh)")
        if isinstance(error, ClusterDownError | RedisClusterException):
            return UnreachableError(f"Redis Cluster at {hosts} is not usable: {error}",
                                    hint="check that every primary runs: redis-cli --cluster check HOST:PORT")
        return _map_redis_error(error)

    def _per_name(self, command: str, names: Sequence[str]) -> list:
        """The replies to `command name` for each name, pipelined BATCH at a time (on a cluster, redis-py
        sends each node the commands for its slots)."""
        with self._session() as client:
            replies = []
            for offset in range(0, len(names), BATCH):
                pipe = client.pipeline(transaction=False)
                for name in names[offset:offset + BATCH]:
                    getattr(pipe, command)(name)
                replies.extend(pipe.execute())
            return replies


def split_eviction_risk(memory_info: dict) -> str | None:
    """Whether a Redis server (its INFO memory section) may evict one of a chunk's two names and keep
    the other: an `allkeys-*` policy with a memory limit evicts names one by one, so `<key>kv_bytes` can
    go while `<key>metadata` stays (LMCache then reports the chunk as stored and fails to read it, and
    only deletes the orphan on the next read), or the reverse (an orphaned value nobody reads). A warning
    for `kvctl health` and `kvctl config validate`; None when there is no such risk (no limit, or a
    policy that never evicts LMCache's names: `noeviction`, `volatile-*` — LMCache sets no TTL)."""
    policy = str(memory_info.get("maxmemory_policy") or "")
    try:
        limit = int(memory_info.get("maxmemory") or 0)
    except (TypeError, ValueError):
        limit = 0
    if not limit or not policy.startswith("allkeys-"):
        return None
    return (f"maxmemory-policy {policy} with maxmemory {_size(limit)} evicts names one at a time: one of a chunk's "
            "two names (<key>kv_bytes, <key>metadata) can go while the other stays, and LMCache then counts a "
            "chunk it cannot read")


def _size(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.4g} {unit}"
    return f"{count} B"


def _map_redis_error(error: Exception):
    import redis

    if isinstance(error, redis.AuthenticationError | redis.exceptions.NoPermissionError):
        return RejectedError(f"Redis refused the credentials: {error}",
                             hint="check the user and password in the Redis URL")
    if isinstance(error, redis.ConnectionError | redis.TimeoutError):
        return UnreachableError(f"cannot reach Redis: {error}",
                                hint="check that redis-server runs and the URL is right")
    return ServerError(f"Redis error: {error}", hint="check the server's log")
