"""Durations as users write them: 600, 30s, 10m, 2h, 1d (a pin's TTL, on the command line or in a pin set)."""

from __future__ import annotations

import re

from kvctl.core.errors import UsageError

DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    match = DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"bad duration {text!r}", hint="write it as 600, 30s, 10m, 2h or 1d")
    return float(match.group(1)) * UNITS[match.group(2)]
