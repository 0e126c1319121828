"""The controller's LMCache version against its engines', and reading it from a local process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import yaml

from kvctl.core.diagnose.controller_checks import local_controller, version_findings
from kvctl.core.diagnose.local_process import command_line, listening_pid, loaded_lmcache_version
from kvctl.core.lmcache.versions import installed
from tests.helpers import wait_until


def test_engines_on_another_version_than_the_controller_are_an_error_naming_them():
    (finding,) = version_findings("0.5.6", {"node-a": "0.5.6", "node-b": "0.4.2"})
    assert finding.level == "error" and finding.check == "controller_version"
    assert "controller runs LMCache 0.5.6" in finding.what and "node-b runs 0.4.2" in finding.what
    assert "node-a" not in finding.what and "rejected at registration" in finding.cost


def test_one_version_everywhere_is_no_finding_and_an_unknown_controller_is_said():
    assert version_findings("0.5.6", {"node-a": "0.5.6", "node-b": "0.5.6"}) == []
    (finding,) = version_findings(None, {"node-a": "0.5.6"})
    assert finding.level == "info" and "unknown" in finding.what


def test_the_process_listening_on_a_port_is_found_with_the_lmcache_beside_its_modules():
    assert yaml.__with_libyaml__  # a C extension from site-packages is mapped into this process
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert listening_pid(port) == os.getpid()
        assert loaded_lmcache_version(os.getpid()) == installed("lmcache")
        found = local_controller(f"http://127.0.0.1:{port}")
        assert found.lmcache_version == installed("lmcache") and found.worker_timeout_s == 300  # no flag: its default
    assert listening_pid(port) is None  # closed: nobody listens


def test_a_process_command_line_is_read_whole():
    argv = [sys.executable, "-c", "import time; time.sleep(30)", "--lmcache-worker-timeout", "7"]
    child = subprocess.Popen(argv)
    try:  # the kernel shows the new command line once the child's exec has settled
        wait_until(lambda: command_line(child.pid), 10, "the child's command line")
        assert command_line(child.pid) == argv
    finally:
        child.kill()
        child.wait()


def test_a_remote_controller_is_never_looked_for_here():
    found = local_controller("http://10.1.2.3:9000")
    assert found.lmcache_version is None and found.worker_timeout_s == 300
