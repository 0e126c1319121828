"""What a server on this host runs, read from /proc where its HTTP API does not say (LMCache's controller
reports no version): the process listening on a port, its command line, the LMCache it loaded.

Everything here answers None rather than guess: another user's process, a container's, or a platform
without /proc are all simply unknown.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp for a listening socket
DIST_INFO = re.compile(r"lmcache-([^-]+)\.dist-info")


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (any address, IPv4 or IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and fields[1].rsplit(":", 1)[-1] == f"{port:04X}":
                inodes.add(fields[9])
    return inodes


def listening_pid(port: int) -> int | None:
    """The pid of the process of this user that listens on `port`, or None."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    if not wanted:
        return None
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            descriptors = os.listdir(f"/proc/{entry.name}/fd")
            if any(os.readlink(f"/proc/{entry.name}/fd/{fd}") in wanted for fd in descriptors):
                return int(entry.name)
        except OSError:  # another user's process, or gone meanwhile
            continue
    return None


def command_line(pid: int) -> list[str]:
    try:
        parts = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return [part.decode(errors="replace") for part in parts if part]
    except OSError:
        return []


def loaded_lmcache_version(pid: int) -> str | None:
    """The LMCache version installed where the process loaded its extension modules from: the
    site-packages directory in its memory map holds lmcache-<version>.dist-info."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    sites = {line[line.index("/"):line.index("site-packages") + len("site-packages")]
             for line in maps.splitlines() if "/site-packages/" in line and "/" in line}
    for site in sorted(sites):
        try:
            names = os.listdir(site)
        except OSError:
            continue
        for name in names:
            if found := DIST_INFO.fullmatch(name):
                return found.group(1)
    return None
