"""How kvctl's fleet commands scale: `health`, `stats`, `ls` and `lookup` over 1, 2, 4 and 8 real
LMCache engines (standalone engines with kvctl's plugins, each holding one cached prompt), through an
inventory file and through LMCache's controller (no inventory at all).

Every figure is the median wall time of the kvctl command (a fresh process, as a user runs it) over
RUNS runs. Goal (issue: deployments kvctl did not launch): from 1 to 8 instances the time grows at
most 1.5x, for every command and both sources. The last line holds the worst ratio of each source.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import STACK_ENV, free_port, standalone_argv  # noqa: E402 - the tests' real-engine plumbing

KVCTL = Path(sys.executable).parent / "kvctl"
SIZES = (1, 2, 4, 8)
RUNS = 5
CHUNK = 256
COMMANDS = {"health": ["health"], "stats": ["stats"], "ls": ["ls"],
            "lookup": ["lookup", "--tokens-file", "{tokens}"]}


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **STACK_ENV})


def stop(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.5)
    raise SystemExit(f"fleet benchmark: {what} not ready after {timeout:g} s")


def median_seconds(argv: list[str], cwd: Path) -> float:
    times = []
    for _ in range(RUNS):
        begin = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
        times.append(time.perf_counter() - begin)
        if done.returncode != 0:
            raise SystemExit(f"fleet benchmark: {' '.join(argv)} exited {done.returncode}: {done.stderr[-500:]}")
    return statistics.median(times)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="kvctl-fleet-bench-"))
    processes: list[subprocess.Popen] = []
    try:
        controller_port = free_port(span=4)
        ports = {"pull": controller_port + 1, "reply": controller_port + 2, "heartbeat": controller_port + 3}
        processes.append(start([sys.executable, "-m", "lmcache.v1.api_server", "--host", "127.0.0.1", "--port",
                                str(controller_port), "--monitor-ports", json.dumps(ports)], root / "controller.log"))
        controller = f"http://127.0.0.1:{controller_port}"
        tokens = root / "tokens.json"
        tokens.write_text(json.dumps(list(range(2 * CHUNK))))
        urls: dict[str, str] = {}
        figures: dict[tuple[str, str, int], float] = {}
        for size in SIZES:  # the fleet grows: the same engines are listed by the inventory and registered
            while len(urls) < size:
                index, port_start = len(urls), free_port(span=110)
                config = root / f"node-{index}"
                subprocess.run([str(KVCTL), "config", "init", "--out", str(config), "--tier", "cpu:0.05",
                                "--controller", f"127.0.0.1:{controller_port}", "--internal-api-port-start",
                                str(port_start), "--hash-algorithm", "builtin"], check=True, capture_output=True)
                processes.append(start(standalone_argv(config), root / f"node-{index}.log"))
                urls[f"kvctl-node-{index}"] = f"http://127.0.0.1:{port_start + 1}"
            for url in urls.values():
                wait_for(lambda url=url: httpx.get(f"{url}/lmc_version", timeout=5).status_code == 200, 300, url)
                httpx.post(f"{url}/cache/store?tokens_mock=0,{2 * CHUNK}", timeout=60).raise_for_status()
            wait_for(lambda size=size: httpx.get(f"{controller}/controller/key-stats", timeout=5).json()[
                "total_instance_count"] == size, 120, f"{size} engines registered")
            work = root / f"size-{size}"
            work.mkdir()
            (work / "kvctl.yaml").write_text(json.dumps({"instances": {name: {"internal_api": url}
                                                                       for name, url in urls.items()}}))
            for command, args in COMMANDS.items():
                argv = [str(KVCTL), *[arg.format(tokens=tokens) for arg in args], "--format", "json"]
                figures[("inventory", command, size)] = median_seconds([*argv, "--instance", "all"], work)
                figures[("controller", command, size)] = median_seconds(
                    [*argv, "--instance", f"controller://127.0.0.1:{controller_port}"], root)
        return report(figures)
    finally:
        stop(processes)


def report(figures: dict[tuple[str, str, int], float]) -> None:
    worst = {}
    for source in ("inventory", "controller"):
        worst[source] = 0.0
        for command in COMMANDS:
            times = [figures[(source, command, size)] for size in SIZES]
            ratio = times[-1] / times[0]
            worst[source] = max(worst[source], ratio)
            print(f"{source:10s} {command:7s} " + "  ".join(f"{size}: {seconds * 1000:5.0f} ms" for size, seconds
                                                           in zip(SIZES, times)) + f"  8/1: {ratio:.2f}x")
    print(f"fleet_8_vs_1 inventory {worst['inventory']:.2f}x controller {worst['controller']:.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
