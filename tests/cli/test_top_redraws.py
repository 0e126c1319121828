"""`kvctl top` on a terminal: redraws in place until Ctrl-C, then exits 0."""

import os
import pty
import select
import signal
import subprocess
import time

from tests.helpers import KVCTL


def test_top_redraws_until_interrupted():
    leader, follower = pty.openpty()
    proc = subprocess.Popen([str(KVCTL), "top", "--instance", "http://127.0.0.1:1", "--interval", "0.3"],
                            stdin=follower, stdout=follower, stderr=follower, env={**os.environ, "COLUMNS": "120"})
    os.close(follower)
    output, deadline = b"", time.monotonic() + 20
    while output.count(b"DOWN") < 3 and time.monotonic() < deadline:
        if select.select([leader], [], [], 0.5)[0]:
            output += os.read(leader, 65536)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 0
    os.close(leader)
    assert output.count(b"DOWN") >= 3  # the unreachable worker, drawn again on every refresh
    assert b"\x1b[2K" in output and b"Traceback" not in output  # lines erased: redrawn in place, not appended
