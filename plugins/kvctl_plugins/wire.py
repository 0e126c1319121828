"""The contract between kvctl and its routes (routes.py, mp_routes.py), in one place both sides import.

Standard library only, and nothing at all at import time: kvctl's client imports this module, and
`kvctl --help` must stay fast (protocol.py, which imports starlette, is for the servers).

* where the routes live (PREFIX), their largest page (MAX_PAGE), the environment variable that holds
  their bearer token (TOKEN_VARIABLE);
* the body of a refusal: {ERROR_CODE: "not_found", ERROR_MESSAGE: "no pin 'x'"};
* the tier names the routes answer with, in LMCache's lookup order, and LMCache's hit rule over
  them (StorageManager.batched_contains): each tier in order serves a prefix of what is still missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PREFIX = "/kvctl/v1"
MAX_PAGE = 10_000  # the most keys one GET {PREFIX}/keys answers (in-process and MP routes alike)
TOKEN_VARIABLE = "KVCTL_ROUTES_TOKEN"  # written to env.sh (0600) by `kvctl config init` for a non-loopback bind

ERROR_CODE = "error"  # a refusal's machine-readable code: bad_request, not_found, unauthorized, ...
ERROR_MESSAGE = "message"  # what a person reads

# kvctl's tier names in LMCache's lookup order (LocalCPUBackend, LocalDiskBackend, a RemoteBackend on
# Redis). An engine's routes answer its own backends' order, which may name "remote" or a backend.
TIER_ORDER = ("cpu", "disk", "redis")


def error_body(code: str, message: str) -> dict[str, str]:
    """What a route answers when it refuses a request (with a 4xx) or fails (with a 5xx)."""
    return {ERROR_CODE: code, ERROR_MESSAGE: message}


def prefix_chunks(flags: Sequence[bool]) -> int:
    """How many chunks from the first one are present: what one tier alone serves."""
    count = 0
    while count < len(flags) and flags[count]:
        count += 1
    return count


def lmcache_hit_chunks(presence: Mapping[str, Sequence[bool]], order: Sequence[str] = TIER_ORDER) -> int:
    """StorageManager.batched_contains: each tier in order serves a prefix of what is still missing.
    `presence` maps a tier to its per-chunk flags; tiers missing from it serve nothing, tiers missing
    from `order` are not asked."""
    total = 0
    for tier in order:
        flags = presence.get(tier)
        if flags is None:
            continue
        while total < len(flags) and flags[total]:
            total += 1
    return total


def hit_tokens(presence: Mapping[str, Sequence[bool]], sizes: Sequence[int],
               order: Sequence[str] = TIER_ORDER) -> dict[str, int]:
    """Tokens served per tier of `order` on its own (0 for a tier not in `presence`), and "total": what
    LMCache serves walking the tiers in that order. `sizes` are the chunks' token counts."""
    hits = {tier: sum(sizes[:prefix_chunks(presence[tier])]) if tier in presence else 0 for tier in order}
    hits["total"] = sum(sizes[:lmcache_hit_chunks(presence, order)])
    return hits
