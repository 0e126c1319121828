"""`kvctl top` on a terminal: redraws in place until Ctrl-C, then exits 0; SIGTERM leaves at once too,
even while a probe hangs and when SIGINT is ignored (a background job of a non-interactive shell)."""

import os
import pty
import select
import signal
import socket
import subprocess
import time

from tests.helpers import KVCTL, default_signals


def start_top(instance: str, *args: str, preexec_fn=default_signals) -> tuple[subprocess.Popen, int]:
    leader, follower = pty.openpty()
    proc = subprocess.Popen([str(KVCTL), "top", "--instance", instance, *args], stdin=follower, stdout=follower,
                            stderr=follower, env={**os.environ, "COLUMNS": "120"}, preexec_fn=preexec_fn)
    os.close(follower)
    return proc, leader


def finish(proc: subprocess.Popen, leader: int) -> None:
    """Whatever the test found, nothing is left running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    os.close(leader)


def test_top_redraws_until_interrupted():
    proc, leader = start_top("http://127.0.0.1:1", "--interval", "0.3")
    try:
        output, deadline = b"", time.monotonic() + 20
        while output.count(b"DOWN") < 3 and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                output += os.read(leader, 65536)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        finish(proc, leader)
    assert output.count(b"DOWN") >= 3  # the unreachable worker, drawn again on every refresh
    assert b"\x1b[2K" in output and b"Traceback" not in output  # lines erased: redrawn in place, not appended


def ignore_sigint() -> None:
    default_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sigterm_leaves_at_once_while_a_probe_hangs_and_sigint_is_ignored():
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        proc, leader = start_top(f"http://127.0.0.1:{silent.getsockname()[1]}", "--timeout", "60",
                                 preexec_fn=ignore_sigint)
        try:
            time.sleep(3)  # kvctl started and its probes are waiting on the silent server
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            assert proc.wait(10) == 0
            assert time.monotonic() - started < 3
        finally:
            finish(proc, leader)
