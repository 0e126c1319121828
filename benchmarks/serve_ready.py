"""`kvctl serve` time-to-ready against launching the same vLLM command by hand.

Both start the plan `kvctl serve --dry-run` prints (vLLM CPU, the tiny model, LMCache in-process
with CPU + disk tiers). By hand: the command and its environment, ready when /health answers. kvctl:
`kvctl serve`, ready when it has written its state file (vLLM listing the model, LMCache's scheduler
and worker APIs answering as LMCache, endpoints recorded). Both runs probe /health the same way
(every POLL_S, one connection pool), so the probe costs both the same CPU; in kvctl's runs it also
shows how long after vLLM answers kvctl is ready. After one unmeasured warm-up `kvctl serve` (which
also writes the configuration both use), ROUNDS pairs in ABBA order (load from other work on a
shared machine drifts); the last line is the ratio of medians (goal <= 1.05).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import free_port, stop_process  # noqa: E402

KVCTL = str(Path(sys.executable).parent / "kvctl")
ROUNDS = 4
POLL_S = 0.02
TIMEOUT_S = 600


def until(ready, proc: subprocess.Popen, what: str, start: float) -> float:
    """Seconds from `start` until `ready()`; fails if `proc` exits first."""
    while not ready():
        if proc.poll() is not None or time.perf_counter() - start > TIMEOUT_S:
            raise SystemExit(f"{what} did not get ready (exit code {proc.poll()})")
        time.sleep(POLL_S)
    return time.perf_counter() - start


def launch(argv: list[str], env: dict, log: Path, health: str, ready=None) -> tuple[float, float]:
    """Start `argv`; seconds until vLLM answers /health, and until `ready()` (default: the same). Stops it."""
    import httpx

    with httpx.Client(trust_env=False, timeout=2) as client:
        def healthy() -> bool:
            try:
                return client.get(health).status_code == 200
            except httpx.HTTPError:
                return False

        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            answered = until(healthy, proc, argv[0], start)
            return answered, until(ready, proc, argv[0], start) if ready else answered
        finally:
            stop_process(proc, grace=120)  # kvctl stops its children in order within this


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "KVCTL_CACHE_DIR": folder}
        args = ["--port", str(free_port()), "--internal-api-port-start", str(free_port())]
        subprocess.run([KVCTL, "-q", "model", "tiny"], env=env, check=True, stdout=subprocess.DEVNULL)
        plan = json.loads(subprocess.run([KVCTL, "serve", "--dry-run", "--format", "json", *args], env=env, check=True,
                                         capture_output=True, text=True).stdout)
        vllm, state, health = plan["components"][-1], Path(plan["state_file"]), f"{plan['endpoints']['vllm']}/health"
        hand_env = {**{name: value for name, value in env.items() if name not in plan["unset_env"]}, **vllm["env"]}

        def by_hand(log: Path) -> float:
            return launch(vllm["argv"], hand_env, log, health)[0]

        def with_kvctl(log: Path) -> tuple[float, float]:
            return launch([KVCTL, "serve", *args], env, log, health, state.exists)

        hand, kvctl, vllm_up = [], [], []
        with_kvctl(Path(folder) / "warm-up.log")  # unmeasured; it also writes the configuration both launches use
        for round_ in range(ROUNDS):
            for run in ("hand", "kvctl") if round_ % 2 == 0 else ("kvctl", "hand"):
                log = Path(folder) / f"{run}-{round_}.log"
                if run == "hand":
                    hand.append(by_hand(log))
                else:
                    answered, ready = with_kvctl(log)
                    kvctl.append(ready)
                    vllm_up.append(answered)
    after = [ready - answered for ready, answered in zip(kvctl, vllm_up)]
    print(f"by hand: {[round(t, 1) for t in hand]} s; kvctl serve: {[round(t, 1) for t in kvctl]} s, of which "
          f"after its vLLM answered /health: {[round(t, 2) for t in after]} s")
    print(f"serve_ready_vs_by_hand={statistics.median(kvctl) / statistics.median(hand):.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
