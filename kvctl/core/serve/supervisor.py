"""Run a launch plan: start each component, wait until it is ready, watch it, stop everything in order.

Every child runs in its own process group (so its own children can be stopped with it) and gets
SIGTERM if kvctl itself dies (Linux PR_SET_PDEATHSIG): nothing is left running behind kvctl.

Readiness is proven, not assumed: each check asks something only the component answers (vLLM lists the
served model, LMCache's APIs their version), straight to it (never through a proxy from the
environment), all of a component's checks at once, every POLL_S. While kvctl waits, a child that exits
or logs a fatal line (a traceback, an ERROR, a port it could not bind) ends the wait within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from kvctl.core.common.display import redact_url
from kvctl.core.errors import KvctlError
from kvctl.core.serve.launch import Component, LaunchPlan, Readiness, flag_value

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 30.0
ABORT_TIMEOUT_S = 5.0  # a start that failed or was cancelled: nothing is served yet, nothing to drain
READY_TIMEOUT_S = 600.0
POLL_S = 0.05
CHECK_TIMEOUT_S = 5.0
FATAL_GRACE_S = 1.0  # after a fatal line, time for the rest of it (a traceback's last lines) to reach the log
LOG_TAIL_LINES = 15
FATAL = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|(?i:address already in use)")
# ERROR lines LMCache 0.5.6 logs on a healthy start: a controller's full-sync command that reaches an engine
# before its storage exists fails and is sent again on the next heartbeat
RETRIED = re.compile(r"Error executing command FullSyncCommand: 'NoneType' object has no attribute")
COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # LMCache colours its log levels


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


def _shown(line: str) -> str:
    """A log line for an error message: no colour codes, passwords in URLs hidden."""
    return redact_url(COLOURS.sub("", line))


def log_tail(path: str, lines: int = LOG_TAIL_LINES, start: int = 0) -> str:
    """The last lines of a child's log (from byte `start` on), passwords in URLs hidden: they end up in an
    error message."""
    try:
        with open(path, "rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    return _shown("\n".join(text.splitlines()[-lines:]))


class LogWatch:
    """What a child adds to its log (which may hold older runs), read as it comes; the first fatal line is
    kept with the time it was seen."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = self.offset = os.path.getsize(path)
        self.partial = b""
        self.fatal: str | None = None
        self.fatal_at = 0.0

    def scan(self) -> None:
        with open(self.path, "rb") as log:
            log.seek(self.offset)
            data = log.read()
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if self.fatal is not None:
            return
        for line in lines:
            text = line.decode(errors="replace")
            if FATAL.search(text) and not RETRIED.search(text):
                self.fatal, self.fatal_at = _shown(text.strip()), time.monotonic()
                return

    def tail(self) -> str:
        """This run's last lines."""
        return log_tail(self.path, start=self.start)


def _vllm_headers(component: Component) -> dict[str, str]:
    """vLLM's /v1 routes want its API key when it has one (--api-key, else VLLM_API_KEY)."""
    key = flag_value(component.argv, "--api-key") or component.env.get("VLLM_API_KEY") or os.environ.get("VLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _answers(client, check: Readiness, headers: dict[str, str]) -> bool:
    """Whether the component itself answers: a 200 whose JSON is what only it says."""
    import httpx

    try:
        response = await client.get(check.target, headers=headers if check.kind == "models" else None)
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return False
    if check.kind == "models":
        models = body.get("data") if isinstance(body, dict) else None
        return isinstance(models, list) and any(isinstance(model, dict) and model.get("id") == check.expect
                                                for model in models)
    if check.kind == "keys":
        return isinstance(body, dict) and all(key in body for key in check.expect)
    return body == check.expect


def _listening(url: str) -> bool:
    """Whether anything accepts connections at the URL's address: a bare connect costs far less than an HTTP
    request through httpx, and kvctl polls on a machine whose cores vLLM needs to start."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=CHECK_TIMEOUT_S).close()
    except OSError:
        return False
    return True


async def _until_ready(client, check: Readiness, headers: dict[str, str]) -> None:
    while not (_listening(check.target) and await _answers(client, check, headers)):
        await asyncio.sleep(POLL_S)


class Supervisor:
    def __init__(self, plan: LaunchPlan, on_progress: Callable[[str], None] = lambda message: None,
                 ready_timeout: float = READY_TIMEOUT_S) -> None:
        self.plan = plan
        self.on_progress = on_progress
        self.ready_timeout = ready_timeout
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, LogWatch] = {}
        self.ready = False
        self.stop_requested: int | None = None  # the signal that asked us to stop

    def request_stop(self, signum: int, _frame=None) -> None:
        self.stop_requested = signum

    def start(self) -> dict[str, int]:
        """Start the components in order, each ready before the next; returns their pids."""
        for component in self.plan.components:
            if self.stop_requested is not None:
                break
            self._start(component)
            asyncio.run(self._wait_ready(component))
        self.ready = self.stop_requested is None
        return {name: proc.pid for name, proc in self.processes.items()}

    def _start(self, component: Component) -> None:
        """Start one child with the inherited environment, less what the plan leaves out, plus its own."""
        Path(component.log).parent.mkdir(parents=True, exist_ok=True)
        env = {name: value for name, value in os.environ.items() if name not in self.plan.unset_env}
        with open_log(component.log) as log:
            self.logs[component.name] = LogWatch(component.log)
            self.processes[component.name] = subprocess.Popen(
                component.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**env, **component.env}, start_new_session=True, preexec_fn=_die_with_parent)

    async def _wait_ready(self, component: Component) -> None:
        """Poll every check of the component at once until all pass; meanwhile watch every child."""
        import httpx

        started, shown = time.monotonic(), None
        headers = _vllm_headers(component)
        async with httpx.AsyncClient(trust_env=False, timeout=CHECK_TIMEOUT_S) as client:
            pending = {asyncio.ensure_future(_until_ready(client, check, headers)): check for check in component.ready}
            try:
                while pending and self.stop_requested is None:
                    self._check_alive()
                    self._check_logs()
                    elapsed = time.monotonic() - started
                    waiting = ", ".join(check.label for check in pending.values())
                    if elapsed > self.ready_timeout:
                        targets = ", ".join(f"{check.label} at {check.target}" for check in pending.values())
                        raise ChildFailed(f"{component.name} was not ready after {self.ready_timeout:.0f} s ({targets})"
                                          f"\n{self.logs[component.name].tail()}", hint=f"read {component.log}")
                    message = f"starting {component.name}: waiting for {waiting} ({elapsed:.0f} s)"
                    if message != shown:
                        self.on_progress(shown := message)
                    done, _ = await asyncio.wait(set(pending), timeout=POLL_S)
                    for task in done:
                        task.result()
                        del pending[task]
            finally:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    def _check_alive(self) -> None:
        for name, proc in self.processes.items():
            code = proc.poll()
            if code is not None:
                raise ChildFailed(f"{name} exited with code {code}; its last log lines:\n{self.logs[name].tail()}",
                                  hint=f"the whole log is {self.logs[name].path}")

    def _check_logs(self) -> None:
        """A fatal line in a starting child's log ends the start, once the rest of the message is in."""
        for name, watch in self.logs.items():
            watch.scan()
            if watch.fatal is not None and time.monotonic() - watch.fatal_at >= FATAL_GRACE_S:
                raise ChildFailed(f"{name} failed while starting: {watch.fatal}\nits last log lines:\n{watch.tail()}",
                                  hint=f"the whole log is {watch.path}")

    def watch(self) -> None:
        """Return when a stop is requested; raise ChildFailed when a component dies."""
        while self.stop_requested is None:
            self._check_alive()
            time.sleep(0.5)

    def stop(self, timeout: float | None = None) -> None:
        """Stop in reverse start order: SIGTERM to the process group, SIGKILL after `timeout` (by default
        STOP_TIMEOUT_S once everything was ready, ABORT_TIMEOUT_S before)."""
        timeout = timeout if timeout is not None else STOP_TIMEOUT_S if self.ready else ABORT_TIMEOUT_S
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
