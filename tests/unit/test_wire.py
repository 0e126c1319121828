"""The contract kvctl shares with its routes (kvctl_plugins.wire) and the one control-character escaper."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvctl_plugins import wire

from kvctl.core.cache import lookup
from kvctl.core.common.display import escape_controls, shown
from kvctl.output import escape, printable

T, F = True, False


def test_wire_imports_nothing_heavy():
    heavy = ("starlette", "fastapi", "lmcache", "torch", "vllm", "httpx")
    code = f"import sys, kvctl_plugins.wire; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_contract_values():
    assert wire.PREFIX == "/kvctl/v1" and wire.MAX_PAGE == 10_000 and wire.TOKEN_VARIABLE == "KVCTL_ROUTES_TOKEN"
    assert wire.error_body("not_found", "no pin 'x'") == {"error": "not_found", "message": "no pin 'x'"}


def test_clients_use_the_contract():
    from kvctl.clients import http, internal_api, mp_server

    assert http.PREFIX is internal_api.PREFIX is mp_server.PREFIX is wire.PREFIX
    assert http.TOKEN_VARIABLE is wire.TOKEN_VARIABLE
    assert http._message(wire.error_body("bad_request", "tokens must be a list")) == "tokens must be a list"
    assert http._message({wire.ERROR_CODE: "forbidden"}) == "forbidden"


def test_lookup_uses_the_one_rule():
    assert lookup.wire_hit_tokens is wire.hit_tokens and lookup.TIER_ORDER is wire.TIER_ORDER


def test_a_tier_not_checked_hits_nothing_known_rather_than_zero():
    """LMCache's rule walks the tiers it has; kvctl's report says None for one it could not see."""
    presence = {"disk": [True, True, False]}
    assert wire.hit_tokens(presence, [256, 256, 100])["cpu"] == 0
    assert lookup.tier_hit_tokens(presence, [256, 256, 100]) == {"cpu": None, "disk": 512, "redis": None,
                                                                 "total": 512}


@pytest.mark.parametrize("flags, expected", [
    ([], 0), ([F], 0), ([T], 1), ([T, T, T], 3), ([T, F, T], 1), ([F, T, T], 0), ((T, T, F), 2),
])
def test_prefix_chunks(flags, expected):
    assert wire.prefix_chunks(flags) == expected


@pytest.mark.parametrize("presence, expected", [
    ({}, 0),
    ({"cpu": [T, T, F, F]}, 2),
    ({"cpu": [T, T, F, F], "disk": [F, F, T, F]}, 3),  # disk serves chunk 2, after cpu's prefix
    ({"cpu": [T, T, F, F], "disk": [T, F, F, T]}, 2),  # disk's own prefix does not reach the gap
    ({"cpu": [T, F, F, F], "disk": [F, T, F, F], "redis": [F, F, T, T]}, 4),
    ({"cpu": [F, F, F], "disk": [T, T, F], "redis": [F, F, T]}, 3),  # cpu serves nothing, the others do
    ({"disk": [T, F, T], "redis": [F, T, F]}, 2),  # no cpu tier at all; redis serves chunk 1, nobody chunk 2
    ({"cpu": [T, F, T], "redis": [F, T, T]}, 3),  # no disk tier: the walk goes straight on
    ({"cpu": [T, F, T], "redis": [F, F, T]}, 1),  # a gap no tier fills ends the hit
    ({"redis": [T, T], "cpu": [F, F]}, 2),  # the walk follows the order, not the mapping's
    ({"disk": [F, T], "redis": [T, F]}, 1),  # a tier already passed is not asked again
])
def test_lmcache_hit_chunks(presence, expected):
    assert wire.lmcache_hit_chunks(presence) == expected


def test_lmcache_hit_chunks_order():
    presence = {"cpu": [F, T], "disk": [T, F]}
    assert wire.lmcache_hit_chunks(presence, ("cpu", "disk")) == 1
    assert wire.lmcache_hit_chunks(presence, ("disk", "cpu")) == 2
    assert wire.lmcache_hit_chunks(presence, ("disk", "cpu", "disk", "cpu")) == 2  # a tier named twice adds nothing
    assert wire.lmcache_hit_chunks({"remote": [T, T], "cpu": [T, F]}, ("cpu", "disk", "remote")) == 2
    assert wire.lmcache_hit_chunks({"remote": [T, T]}) == 0  # a tier not in the order is never asked


def test_hit_tokens():
    sizes = [256, 256, 100]
    presence = {"cpu": [T, F, F], "disk": [F, T, T]}
    assert wire.hit_tokens(presence, sizes) == {"cpu": 256, "disk": 0, "redis": 0, "total": 612}
    assert wire.hit_tokens(presence, sizes, ["disk", "cpu"]) == {"disk": 0, "cpu": 256, "total": 256}
    assert wire.hit_tokens({}, sizes) == {"cpu": 0, "disk": 0, "redis": 0, "total": 0}
    assert wire.hit_tokens({"cpu": []}, [], ["cpu"]) == {"cpu": 0, "total": 0}


# -- the escaper ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, escaped", [
    ("plain text, ünïcode, 漢字, emoji 🙂 and \\ backslash", "plain text, ünïcode, 漢字, emoji 🙂 and \\ backslash"),
    ("a\x1b[31mred\x1b[0m", "a\\x1b[31mred\\x1b[0m"),  # ANSI colour
    ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),  # OSC: the window title
    ("\x00\x08\x7f", "\\x00\\x08\\x7f"),
    ("\x9b2J\x85", "\\x9b2J\\x85"),  # C1 controls (CSI, NEL)
    ("file\u202egpj.exe", "file\\u202egpj.exe"),  # bidi override
    ("\u2066x\u2069\u200f\u061c", "\\u2066x\\u2069\\u200f\\u061c"),  # isolates, RLM, Arabic letter mark
    ("zero\u200bwidth\u2028line", "zero\\u200bwidth\\u2028line"),
    ("tag\U000e0041", "tag\\U000e0041"),
    ("a\nb\tc\rd", "a\\nb\\tc\\rd"),
])
def test_escape_controls(text, escaped):
    assert escape_controls(text) == escaped
    assert "\x1b" not in escape_controls(text)


def test_escape_controls_keeps_lines_when_asked():
    assert escape_controls("one\n\ttwo\r\x1b[2K", keep_lines=True) == "one\n\ttwo\\r\\x1b[2K"
    assert escape_controls("one\n\ttwo", keep_lines=False) == "one\\n\\ttwo"


def test_output_escapes_as_display_does():
    assert printable("key\x1b[31m\nnext") == "key\\x1b[31m\nnext"  # messages keep their lines
    assert printable("key\x1b[31m\nnext", lines=False) == "key\\x1b[31m\\nnext"  # a table cell does not
    assert printable("evil\x1b]0;pwned\x07\u202e", lines=False) == "evil\\x1b]0;pwned\\x07\\u202e"
    assert escape("[bold]x\x1b[0m[/bold]\n") == "\\[bold]x\\x1b[0m\\[/bold]\n"


def test_shown_never_cuts_an_escape():
    assert shown("\x1b" * 100, 10) == "\\x1b\\x1b…"
    assert shown("ab\ncd") == "ab\\ncd"
    assert shown("a" * 8 + "\x1b", 10) == "a" * 8 + "…"


# -- frames -------------------------------------------------------------------------------------------


def frame(header: bytes, data: bytes = b"") -> bytes:
    return wire.FRAME_LENGTH.pack(len(header)) + header + data


def test_frames_round_trip():
    body = wire.frame_header("k1", 3, b"\x01\x02") + b"abc" + wire.frame_header("k2", 0, None)
    assert [(key, bytes(data), metadata) for key, data, metadata in wire.read_frames(body)] == [
        ("k1", b"abc", b"\x01\x02"), ("k2", b"", None)]


@pytest.mark.parametrize("body, message", [
    (frame(b"[" * 8000), "not {key, size, metadata}"),  # nested past Python's stack: was a RecursionError
    (frame(b'{"key": "k", "size": 1, "metadata": null}' + b" " * 9000), "malformed or cut short"),
    (frame(b"[1, 2]"), "not {key, size, metadata}"),
    (frame(b'{"key": "k", "size": 1, "metadata": 7}', b"x"), "not {key, size, metadata}"),
    (frame(b'{"key": 1, "size": 1, "metadata": null}', b"x"), "bad key or size"),
    (frame(b'{"key": "k", "size": true, "metadata": null}', b"x"), "bad key or size"),
    (frame(b'{"key": "k", "size": 5, "metadata": null}', b"x"), "cut short"),
    (b"\0\0", "cut short"),
])
def test_a_malformed_frame_is_a_value_error(body, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        list(wire.read_frames(body))
