"""LMCache's controller as kvctl addresses it: `controller://HOST:PORT`, and the ports kvctl's
configurations give it."""

from __future__ import annotations

from kvctl.core.errors import UsageError

SCHEME = "controller://"
WORKER_PORT_OFFSET = 100  # kvctl's configurations: controller port = internal API port + 100
STALE_AFTER_S = 60.0  # kvctl's configurations beat every 5 s: twelve missed heartbeats
DISCOVERY_TIMEOUT_S = 5.0


def is_controller(instance: str | None) -> bool:
    return bool(instance) and instance.startswith(SCHEME)


def stale_limit(instance: str) -> float:
    """`controller://HOST:PORT?stale_after_s=N`: how old a heartbeat may be (default STALE_AFTER_S)."""
    from urllib.parse import parse_qs

    _, _, query = instance.partition("?")
    given = parse_qs(query).get("stale_after_s")
    try:
        limit = float(given[-1]) if given else STALE_AFTER_S
    except ValueError:
        limit = -1.0
    if not 0 < limit < 86_400:
        raise UsageError(f"stale_after_s={given[-1][:40]!r} is not a number of seconds (0 to 86400)",
                         hint="e.g. controller://127.0.0.1:9000?stale_after_s=30")
    return limit


def http_url(instance: str) -> str:
    """controller://HOST:PORT -> http://HOST:PORT (an http(s):// URL stays as given; a query is kvctl's)."""
    instance = instance.partition("?")[0]
    rest = instance[len(SCHEME):] if is_controller(instance) else instance
    if "://" in rest:
        return rest.rstrip("/")
    if not rest or ":" not in rest.rsplit("]", 1)[-1]:
        raise UsageError(f"{instance!r} names no controller port", hint="write controller://HOST:PORT (the "
                         "controller's HTTP port, 9000 by default)")
    return f"http://{rest.rstrip('/')}"
