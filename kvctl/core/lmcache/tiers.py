"""Tier specs as users write them (`cpu:4`, `disk:/var/cache/kv:50`, `redis://host:6379/0`).

Tiers are named the way users say them: cpu, disk, redis. LMCache's own names
(LocalCPUBackend, LocalDiskBackend, RemoteBackend) only appear where kvctl talks to LMCache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import unquote

from kvctl.core.common.display import shown
from kvctl.core.errors import UsageError

REDIS_SCHEMES = ("redis", "rediss", "redis-sentinel", "redis-cluster")
DEFAULT_REDIS_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class RedisURL:
    """A parsed Redis URL in one of the forms LMCache's remote connectors accept."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    db: int = 0
    service_name: str | None = None  # sentinel only: the master's name, from the path

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    def url(self, redact: bool = False) -> str:
        auth = ""
        if self.username or self.password:
            password = "***" if redact and self.password else (self.password or "")
            auth = f"{self.username or ''}:{password}@" if self.password is not None else f"{self.username}@"
        hosts = ",".join(f"{host}:{port}" for host, port in self.hosts)
        path = ""
        if self.scheme == "redis-sentinel" and self.service_name:
            path = f"/{self.service_name}"
        elif self.db:
            path = f"/{self.db}"
        return f"{self.scheme}://{auth}{hosts}{path}"


def parse_redis_url(url: str) -> RedisURL:
    """Parse `redis://[user:pass@]host:port[/db]`, `rediss://…`, `redis-sentinel://…`, `redis-cluster://…`."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in REDIS_SCHEMES:
        raise UsageError(
            f"not a Redis URL: {shown(url, quoted=True)}",
            hint="use redis://[user:pass@]host:port[/db], rediss://…, redis-sentinel://h1:p1,h2:p2/master "
            "or redis-cluster://h1:p1,h2:p2",
        )
    netloc, _, path = rest.partition("/")
    path, _, _query = path.partition("?")
    username = password = None
    if "@" in netloc:
        auth, _, netloc = netloc.rpartition("@")
        user_part, colon, pass_part = auth.partition(":")
        username = unquote(user_part) or None
        password = unquote(pass_part) if colon else None
    multi = scheme in ("redis-sentinel", "redis-cluster")
    host_specs = netloc.split(",") if multi else [netloc]
    default_port = DEFAULT_SENTINEL_PORT if scheme == "redis-sentinel" else DEFAULT_REDIS_PORT
    hosts = tuple(_parse_host_port(spec, default_port, url) for spec in host_specs)
    db = 0
    service_name = None
    if scheme == "redis-sentinel":
        service_name = path or None
    elif path:
        if not path.isdigit():
            raise UsageError(f"Redis database must be a number in {shown(url, quoted=True)}, "
                             f"got {shown(path, quoted=True)}",
                             hint="write the database index after the port, e.g. redis://127.0.0.1:6379/0")
        db = int(path)
    return RedisURL(scheme, hosts, username, password, db, service_name)


def _parse_host_port(spec: str, default_port: int, url: str) -> tuple[str, int]:
    if not spec:
        raise UsageError(f"Redis URL {shown(url, quoted=True)} has no host", hint="write it as redis://host:port")
    if spec.startswith("["):  # [ipv6]:port
        host, _, port_text = spec[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UsageError(f"bad port {shown(port_text, quoted=True)} in Redis URL {shown(url, quoted=True)}",
                         hint="ports are numbers from 1 to 65535")
    return host, int(port_text)


@dataclass(frozen=True)
class TierSpec:
    """One `--tier` value. Sizes in GB; None means "size it from this machine"."""

    name: str
    size_gb: float | None = None
    path: str | None = None
    redis: RedisURL | None = None


def parse_tier(text: str) -> TierSpec:
    """Parse `cpu[:GB]`, `disk:PATH[:GB]` or a Redis URL."""
    if "://" in text:
        return TierSpec("redis", redis=parse_redis_url(text))
    name, _, rest = text.partition(":")
    if name == "cpu":
        return TierSpec("cpu", size_gb=_parse_size(rest, text) if rest else None)
    if name == "disk":
        if not rest:
            raise UsageError(f"disk tier needs a path: {shown(text, quoted=True)}",
                             hint="write it as disk:PATH[:GB], e.g. disk:/var/cache/kv:50")
        path, size = rest, None
        head, colon, tail = rest.rpartition(":")
        if colon and _is_number(tail):
            path, size = head, _parse_size(tail, text)
        if not path:
            raise UsageError(f"disk tier needs a path: {shown(text, quoted=True)}", hint="write it as disk:PATH[:GB]")
        return TierSpec("disk", size_gb=size, path=path)
    raise UsageError(
        f"unknown tier {shown(text, quoted=True)}",
        hint="use cpu[:GB], disk:PATH[:GB] or a redis://, rediss://, redis-sentinel://, redis-cluster:// URL",
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parse_size(text: str, spec: str) -> float:
    """A size in GB: a finite number above 0 (nan and inf parse as floats, and nan passes every `<= 0`)."""
    if not _is_number(text) or not math.isfinite(float(text)) or float(text) <= 0:
        raise UsageError(f"bad size {shown(text, quoted=True)} in tier {shown(spec, quoted=True)}",
                         hint="sizes are positive numbers of GB, e.g. cpu:4")
    return float(text)
