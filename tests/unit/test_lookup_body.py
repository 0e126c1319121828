"""The lookup route parses its body in one pass of C (engine_ops.lookup_tokens); every body must come
out as the common way (json.loads + protocol.tokens) makes it: the same token ids, or the same refusal."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvctl_plugins import engine_ops, protocol

MAX_ID = protocol.MAX_TOKEN_ID


def common_way(raw: bytes):
    try:
        return protocol.tokens(protocol.parse_body(raw).get("tokens"))
    except protocol.Rejected as refusal:
        return type(refusal), str(refusal)


def fast_way(raw: bytes):
    try:
        return engine_ops.lookup_tokens(raw)
    except protocol.Rejected as refusal:
        return type(refusal), str(refusal)


ODD_BODIES = [
    b'{"tokens": [1, 2, 3]}', b'{"tokens": [0, 2147483647]}', b'{"tokens": [-0]}', b' {"tokens":[5]}\n',
    b'{"tokens": [1], "tokens": [2, 3]}',  # the last one counts, as in json.loads
    b'{"tokens": [1], "ttl_s": 3}', b'{"tokens": [1], "x": NaN}', b'{"tokens": [1], "x": "\xff"}',
    b'\xef\xbb\xbf{"tokens": [1]}', '{"tokens": [7]}'.encode("utf-16"),
    b'{"tokens": []}', b'{"tokens": [true]}', b'{"tokens": [1.0]}', b'{"tokens": [1e2]}', b'{"tokens": [-1]}',
    b'{"tokens": [2147483648]}', b'{"tokens": [99999999999999999999999999]}', b'{"tokens": "abc"}',
    b'{"tokens": null}', b'{"tokens": [[1]]}', b'{}', b'', b'[1, 2]', b'{"tokens": [1]', b'{"tokens": [1]}x',
    b'{"tokens": [Infinity]}', b'[' * 100_000 + b']' * 100_000,
]


@pytest.mark.parametrize("raw", ODD_BODIES, ids=range(len(ODD_BODIES)))
def test_odd_bodies_are_answered_as_before(raw):
    assert fast_way(raw) == common_way(raw)


def test_too_many_tokens_are_refused_as_before():
    raw = json.dumps({"tokens": [1] * (protocol.MAX_TOKENS + 1)}).encode()
    assert fast_way(raw) == common_way(raw)
    assert fast_way(raw)[0] is protocol.BadRequest


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, MAX_ID + 2) | st.floats() | st.text(max_size=3),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
                    max_leaves=8)


@given(st.lists(st.integers(-2, MAX_ID + 2) | JSON, max_size=6), st.dictionaries(st.sampled_from(["x", "ttl_s"]), JSON))
def test_any_body_is_answered_as_before(tokens, others):
    raw = json.dumps({"tokens": tokens, **others}).encode()
    assert fast_way(raw) == common_way(raw)
