"""The routes token is compared in constant time: a timing side channel must not reveal it byte by byte."""

from __future__ import annotations

import hmac

import pytest
from kvctl_plugins import protocol
from starlette.requests import Request

TOKEN = "the-routes-token-0123456789"


def request(authorization: str) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/kvctl/v1/info", "server": ("127.0.0.1", 8000),
                    "headers": [(b"host", b"127.0.0.1"), (b"authorization", authorization.encode())]})


def test_the_token_is_compared_with_compare_digest(monkeypatch):
    compared, original = [], hmac.compare_digest

    def recording(given, expected):
        compared.append((given, expected))
        return original(given, expected)

    monkeypatch.setattr(protocol.hmac, "compare_digest", recording)
    protocol.check_token(request(f"Bearer {TOKEN}"), TOKEN)
    with pytest.raises(protocol.Unauthorized):
        protocol.check_token(request(f"Bearer {TOKEN[:-1]}x"), TOKEN)  # differs in its last byte only
    assert compared == [(TOKEN.encode(), TOKEN.encode()), ((TOKEN[:-1] + "x").encode(), TOKEN.encode())]
