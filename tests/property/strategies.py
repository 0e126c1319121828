"""What a hostile file, body or argument looks like: random bytes and text, and the shapes that broke
parsers before (brackets nested past Python's stack, 400-digit numbers, alias bombs, YAML tags, NUL bytes,
deep JSON), mixed with well-formed JSON and YAML of the wrong shape."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from kvctl.core.errors import KvctlError

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False), st.text(max_size=40))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda children: st.one_of(
    st.lists(children, max_size=6), st.dictionaries(st.text(max_size=12), children, max_size=6)), max_leaves=40)

KNOWN_BAD = st.sampled_from([
    b"[" * 8000, b"{\"a\":" * 5000, b"- " * 5000 + b"x", b"9" * 400, b"-" + b"9" * 5000, b"1e999", b"NaN",
    b"a: &a [*a]\n", b"!!python/object/apply:os.system ['true']\n", b"\x00" * 64, b"\xff\xfe\xfd",
    b'l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + b"".join(f"l{n}: &l{n} [{','.join([f'*l{n - 1}'] * 9)}]\n".encode() for n in range(1, 9)),
    b"[]", b"{}", b"null", b"true", b'"text"', b"---\n...\n", b"\t\n\r ", b"",
])


def json_bytes(values=JSON_VALUES):
    return values.map(lambda value: json.dumps(value).encode())


def hostile_bytes(*shaped):
    """Any of: known breakers, random bytes and text, JSON of any shape, and `shaped` (well-formed input
    of roughly the right shape, for the parser's deeper branches)."""
    return st.one_of(KNOWN_BAD, st.binary(max_size=300), st.text(max_size=200).map(str.encode), json_bytes(),
                     *shaped)


def refused_in_one_line(call) -> object:
    """Run `call`: it answers, or refuses with a KvctlError of one line with a hint; anything else
    (a traceback's worth: RecursionError, TypeError, OverflowError …) fails the property."""
    try:
        return call()
    except KvctlError as error:
        assert error.message and "\n" not in error.message, repr(error.message)
        assert error.hint and "\n" not in error.hint, (error.message, error.hint)
        assert len(error.message) < 2000, error.message[:200]  # never echoes megabytes
        return error
