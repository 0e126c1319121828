"""`kvctl serve` time-to-ready against launching the same vLLM command by hand.

Both start the plan `kvctl serve --dry-run` prints (vLLM CPU, the tiny model, LMCache in-process
with CPU + disk tiers). By hand: the command and its environment, ready when /health answers.
kvctl: `kvctl serve`, ready when it has written its state file (vLLM healthy, LMCache's worker API
answering, endpoints recorded). After one unmeasured warm-up `kvctl serve` (which also writes the
configuration both use), alternating runs, two each; the last line is the ratio of medians
(goal <= 1.05).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import free_port, stop_process, wait_until  # noqa: E402

KVCTL = str(Path(sys.executable).parent / "kvctl")
ROUNDS = 2


def by_hand(plan: dict, log: Path) -> float:
    import httpx

    component = plan["components"][-1]
    start = time.perf_counter()
    proc = subprocess.Popen(component["argv"], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **component["env"]}, start_new_session=True)
    try:
        url = component["ready"][0]["target"]
        wait_until(lambda: httpx.get(url, timeout=2).status_code == 200, 600, "vLLM by hand", proc, log)
        return time.perf_counter() - start
    finally:
        stop_process(proc, grace=30)


def with_kvctl(env: dict, args: list[str], state: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([KVCTL, "serve", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_until(lambda: state.exists(), 600, "kvctl serve", proc)
        return time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "KVCTL_CACHE_DIR": folder}
        args = ["--port", str(free_port()), "--internal-api-port-start", str(free_port())]
        subprocess.run([KVCTL, "-q", "model", "tiny"], env=env, check=True, stdout=subprocess.DEVNULL)
        plan = json.loads(subprocess.run([KVCTL, "serve", "--dry-run", "--format", "json", *args], env=env, check=True,
                                         capture_output=True, text=True).stdout)
        state = Path(plan["state_file"])
        hand, kvctl = [], []
        with_kvctl(env, args, state)  # unmeasured warm-up; it also writes the configuration both launches use
        for round_ in range(ROUNDS):
            hand.append(by_hand(plan, Path(folder) / f"hand-{round_}.log"))
            kvctl.append(with_kvctl(env, args, state))
    print(f"by hand: {[round(t, 1) for t in hand]} s; kvctl serve: {[round(t, 1) for t in kvctl]} s")
    print(f"serve_ready_vs_by_hand={statistics.median(kvctl) / statistics.median(hand):.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
