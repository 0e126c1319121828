"""`kvctl serve --mode mp` with a password-protected Redis: the real `lmcache server`, started from kvctl's
launch plan, authenticates through LMCACHE_RESP_PASSWORD while its command line (what `ps` shows every
user) holds no password; chunks stored by LMCache's own MP client reach Redis."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.clients.mp_server import MPServerClient
from kvctl.core.serve.launch import build_plan
from tests.helpers import STACK_ENV, free_port, run_cli, start_process, stop_process, wait_until

STORE_SCRIPT = Path(__file__).parent / "scripts" / "mp_store.py"
PASSWORD = "s3cret-for-resp"


@pytest.mark.slow
def test_mp_server_reaches_a_password_protected_redis_without_the_password_on_its_command_line(
        tmp_path, start_redis, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    redis = start_redis(password=PASSWORD)
    port, http_port = free_port(), free_port()
    init = run_cli("config", "init", "--mode", "mp", "--out", tmp_path / "cfg", "--tier", "cpu:0.05", "--tier",
                   redis.url, "--mp-port", port, "--mp-http-port", http_port)
    assert init.code == 0, init.stderr
    server = build_plan(model=None, mode="mp", tiers=[], config=tmp_path / "cfg", start_coordinator=False,
                        write=False).components[0]
    log = tmp_path / "server.log"
    proc = start_process(server.argv, log, env=server.env)
    try:
        http = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: MPServerClient(http).info(), 120, "lmcache server", proc, log)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert "--l2-adapter" in cmdline and PASSWORD not in cmdline
        done = subprocess.run([sys.executable, str(STORE_SCRIPT), f"tcp://127.0.0.1:{port}", http,
                               json.dumps(list(range(512)))], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **STACK_ENV})
        assert done.returncode == 0, done.stderr[-3000:]
        wait_until(lambda: redis.client().dbsize() > 0, 30, "chunks in the password-protected Redis", proc, log)
    finally:
        stop_process(proc)
