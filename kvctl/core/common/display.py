"""What of a user's value may be shown on a screen, in a message or in JSON: no passwords, no raw
control characters (a value could rewrite the terminal), and never megabytes of it.
"""

from __future__ import annotations

import re
from typing import Any

SHOWN_CHARS = 80  # a value echoed in a message
PATH_CHARS = 4096  # a path echoed in a message (PATH_MAX): escaped, hardly ever cut
# scheme://authority: the authority runs to the first "/" or blank, like parse_redis_url's netloc.
_AUTHORITY = re.compile(r"://([^/\s]*)")
# ?password=…, &token=…: the value of a secret-looking query parameter. Names are bounded in length,
# so matching stays linear on any input.
_SECRET_PARAMETER = re.compile(
    r"([?&;][^=&;?#\s]{0,40}(?:pass|pwd|secret|token|api[_-]?key|access[_-]?key|signature|credential)"
    r"[^=&;?#\s]{0,40}=)"
    r"[^&;#\s]+",
    re.IGNORECASE,
)


def _hide_userinfo(match: re.Match) -> str:
    userinfo, at, hosts = match.group(1).rpartition("@")  # passwords may hold "@": the last one ends them
    user, colon, password = userinfo.partition(":")
    if not (at and colon and password):
        return match.group(0)
    return f"://{user}:***@{hosts}"


def redact_url(text: str) -> str:
    """`text` with the password of every URL in it (any scheme: redis://, rediss://, unix://, http://,
    s3://…) and every secret query parameter (`?password=`, `&token=`…) replaced by ***."""
    if "://" in text:
        text = _AUTHORITY.sub(_hide_userinfo, text)
    return _SECRET_PARAMETER.sub(r"\1***", text) if "=" in text else text


def escape_controls(text: str, keep_lines: bool = False) -> str:
    """`text` with every character that is not printable written as Python writes it in a repr
    (\\n, \\t, \\x1b, \\u202e, \\U000e0001): terminal escapes, C1 controls, bidi overrides and
    isolates, zero-width and other format characters, line separators. With `keep_lines`, newlines
    and tabs stay as they are (a multi-line message); a carriage return never does. Backslashes stay
    as they are: the result is for a person, not to be parsed back."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() or (keep_lines and char in "\n\t")
                   else char.encode("unicode_escape").decode("ascii") for char in text)


def cut_long_words(message: str, limit: int = SHOWN_CHARS) -> str:
    """A message composed elsewhere (Click's usage errors) with each quoted value, and each run of
    non-space characters, longer than `limit` cut with an ellipsis: a prompt pasted as an option value
    stays one short line."""
    import re

    def cut(long) -> str:
        return long.group()[:limit - 1] + "…"

    quoted_cut = re.sub(rf"'[^'\n]{{{limit},}}'", lambda long: cut(long) + "'", message)
    return re.sub(rf"[^\s…]{{{limit + 1},}}", cut, quoted_cut)


def shown(value: Any, limit: int = SHOWN_CHARS, quoted: bool = False) -> str:
    """`value` (its repr unless a plain string, or with `quoted`) for a message: passwords redacted,
    control characters escaped, at most `limit` characters (cut with an ellipsis)."""
    text = redact_url(repr(value) if quoted or not isinstance(value, str) else value)
    pieces, length = [], 0
    for char in text:
        piece = escape_controls(char)  # one character at a time: the cut never splits an escape
        if length + len(piece) > limit:
            while length + 1 > limit:  # room for the ellipsis
                length -= len(pieces.pop())
            return "".join(pieces) + "…"
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces)


def format_bytes(value) -> str:
    """A byte count for a table cell: 1.5 GiB, 512.0 MiB, 12 B; '-' for unknown."""
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return str(value)
