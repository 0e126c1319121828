"""Load a configuration with LMCache's own machinery and report what LMCache says about it.

Run as `python -m kvctl.core.lmcache.probe {inprocess|mp} FILE` (a child process: importing
lmcache costs seconds and LMCache logs freely). The last stdout line is
`KVCTL_PROBE {"available": bool, "error": str|null, "warnings": [str]}`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

MARKER = "KVCTL_PROBE "


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _probe(mode: str, path: str) -> dict[str, Any]:
    try:
        import yaml

        if mode == "inprocess":
            from lmcache.v1.config import LMCacheEngineConfig
        else:
            from lmcache.v1.distributed.config import parse_args_to_config
            from lmcache.v1.multiprocess import http_server
    except ImportError as error:
        return {"available": False, "error": None, "warnings": [], "reason": str(error)}
    collector = _Collector()
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).addHandler(collector)
    error = None
    try:
        if mode == "inprocess":
            LMCacheEngineConfig.from_file(path).validate()
        else:
            import argparse

            from kvctl.core.config.init import mp_server_argv

            with open(path) as handle:
                values = yaml.safe_load(handle) or {}
            parser = argparse.ArgumentParser(prog="lmcache server", exit_on_error=False)
            for add_args in (http_server.add_http_frontend_args, http_server.add_mp_server_args,
                             http_server.add_p2p_args, http_server.add_storage_manager_args,
                             http_server.add_observability_args, http_server.add_coordinator_args):
                add_args(parser)
            args = parser.parse_args(mp_server_argv(values))
            parse_args_to_config(args)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever LMCache raises is the finding
        error = f"{type(exc).__name__}: {exc}"
    return {"available": True, "error": error, "warnings": collector.messages}


def run_probe(mode: str, path: str, timeout: float = 120) -> dict[str, Any]:
    """Run the probe in a child process of this interpreter and return its report."""
    env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false", PYTHONWARNINGS="ignore")
    try:
        done = subprocess.run([sys.executable, "-m", "kvctl.core.lmcache.probe", mode, path], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"available": False, "error": None, "warnings": [],
                "reason": f"LMCache did not answer in {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    return {"available": False, "error": None, "warnings": [],
            "reason": (done.stderr.strip().splitlines() or ["?"])[-1]}


if __name__ == "__main__":
    report = _probe(sys.argv[1], sys.argv[2])
    sys.stdout.write("\n" + MARKER + json.dumps(report) + "\n")
