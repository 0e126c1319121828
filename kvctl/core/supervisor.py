"""Run a launch plan: start each component, wait until it is ready, watch it, stop everything in order.

Every child runs in its own process group (so its own children can be stopped with it) and gets
SIGTERM if kvctl itself dies (Linux PR_SET_PDEATHSIG): nothing is left running behind kvctl.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvctl.core.display import redact_url
from kvctl.core.errors import KvctlError
from kvctl.core.launch import Component, LaunchPlan, Readiness

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 15


class ChildFailed(KvctlError):
    """A component exited or never became ready."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def open_log(path: str):
    """A child's log for appending, owner-only: servers log their configuration, Redis URLs included.
    Created 0600 (never readable by others, not even for a moment); one left by an older kvctl is narrowed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a child's log, passwords in URLs hidden: they end up in an error message."""
    try:
        return redact_url("\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]))
    except OSError:
        return ""


def _ready(check: Readiness) -> bool:
    if check.kind == "path":
        return os.path.exists(check.target)
    import httpx

    try:
        return httpx.get(check.target, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Supervisor:
    def __init__(self, plan: LaunchPlan, on_progress: Callable[[str], None] = lambda message: None) -> None:
        self.plan = plan
        self.on_progress = on_progress
        self.processes: dict[str, subprocess.Popen] = {}
        self.stop_requested: int | None = None  # the signal that asked us to stop

    def request_stop(self, signum: int, _frame=None) -> None:
        self.stop_requested = signum

    def start(self) -> dict[str, int]:
        """Start the components in order, each ready before the next; returns their pids."""
        for component in self.plan.components:
            self._start(component)
            self._wait_ready(component)
        return {name: proc.pid for name, proc in self.processes.items()}

    def _start(self, component: Component) -> None:
        Path(component.log).parent.mkdir(parents=True, exist_ok=True)
        with open_log(component.log) as log:
            self.processes[component.name] = subprocess.Popen(
                component.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **component.env}, start_new_session=True, preexec_fn=_die_with_parent)

    def _wait_ready(self, component: Component) -> None:
        started = time.monotonic()
        pending = list(component.ready)
        while pending:
            self._check_alive()
            if self.stop_requested is not None:
                return
            elapsed = time.monotonic() - started
            if elapsed > READY_TIMEOUT_S:
                raise ChildFailed(f"{component.name} was not ready after {READY_TIMEOUT_S:.0f} s "
                                  f"({pending[0].label})\n{log_tail(component.log)}", hint=f"read {component.log}")
            self.on_progress(f"starting {component.name}: waiting for {pending[0].label} ({elapsed:.0f} s)")
            if _ready(pending[0]):
                pending.pop(0)
                continue
            time.sleep(0.5)

    def _check_alive(self) -> None:
        for name, proc in self.processes.items():
            code = proc.poll()
            if code is not None:
                log = next(c.log for c in self.plan.components if c.name == name)
                raise ChildFailed(f"{name} exited with code {code}; its last log lines:\n{log_tail(log)}",
                                  hint=f"the whole log is {log}")

    def watch(self) -> None:
        """Return when a stop is requested; raise ChildFailed when a component dies."""
        while self.stop_requested is None:
            self._check_alive()
            time.sleep(0.5)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop in reverse start order: SIGTERM to the process group, SIGKILL after `timeout`."""
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                self.on_progress(f"stopping {name}")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the group left behind
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
