"""Every `/kvctl/v1` route of a real standalone engine (CPU + disk tiers, some chunks cached) with arbitrary
bodies, headers and query strings: never a 500, always a JSON answer whose refusal is one line, and a
refusal changes nothing (the tiers' keys and the pins are as before)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import http_json
from tests.integration.test_plugin_routes import CHUNK, CPU_GB, running_engine
from tests.property.strategies import JSON_VALUES, hostile_bytes, json_bytes

pytestmark = pytest.mark.slow

ROUTES = [("GET", "/info"), ("POST", "/lookup"), ("GET", "/keys"), ("POST", "/pin"), ("POST", "/unpin"),
          ("GET", "/pins"), ("POST", "/evict"), ("POST", "/prefetch"), ("POST", "/chunks/read"),
          ("POST", "/chunks/write")]
FIELDS = ["tokens", "keys", "tiers", "ttl_s", "pin_id", "replace", "dry_run", "force", "tier", "offset", "limit"]
BODIES = hostile_bytes(json_bytes(st.dictionaries(st.sampled_from(FIELDS), st.one_of(
    JSON_VALUES, st.lists(st.integers(-1, 2**40), max_size=3 * CHUNK), st.lists(st.text(max_size=80), max_size=4)),
    max_size=4)))
ASCII = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
HEADER_VALUES = ASCII.map(str.strip).filter(bool)  # what an HTTP client can send at all
HEADERS = st.dictionaries(st.sampled_from(["content-type", "authorization", "content-encoding", "x-kvctl-next",
                                           "accept", "range"]),
                          st.one_of(HEADER_VALUES, st.sampled_from(["application/json", "application/octet-stream",
                                                            "gzip", "Bearer x", "multipart/form-data"])), max_size=3)
QUERIES = st.dictionaries(st.sampled_from(["tier", "offset", "limit", "tiers", "tokens", "x"]),
                          st.one_of(ASCII, st.integers(-2**70, 2**70).map(str)), max_size=3)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("route-properties")
    with running_engine(root, f"cpu:{CPU_GB}", f"disk:{root}/disk:1") as started:
        stored = http_json("POST", f"{started['url']}/cache/store", params={"tokens_mock": f"0,{3 * CHUNK}"})
        assert stored["num_tokens"] == 3 * CHUNK
        with httpx.Client(base_url=f"{started['url']}/kvctl/v1", timeout=60) as http:
            yield started, http


def held(http) -> tuple:
    """What a refusal must leave as it was: every tier's keys and the pins."""
    tiers = {tier: {entry["key"] for entry in http.get("/keys", params={"tier": tier, "limit": 1000}).json()["keys"]}
             for tier in ("cpu", "disk")}
    return tiers, {pin["pin_id"] for pin in http.get("/pins").json()["pins"]}


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[path for _, path in ROUTES])
@given(body=BODIES, headers=HEADERS, query=QUERIES)
def test_no_route_answers_500_or_changes_anything_it_refuses(engine, method, path, body, headers, query):
    _started, http = engine
    before = held(http)
    answer = http.request(method, path, content=body, headers=headers, params=query)
    assert answer.status_code < 500, (answer.status_code, answer.text[:500])
    if answer.status_code >= 400:
        refusal = answer.json()
        assert set(refusal) >= {"error", "message"}, refusal
        assert "\n" not in refusal["message"] and len(refusal["message"]) < 2000, refusal
        assert held(http) == before
    elif answer.headers.get("content-type", "").startswith("application/json"):
        answer.json()
