"""kvctl's /kvctl/v1/lookup route on a 128K-token prompt, inside a real LMCache engine.

A standalone LMCache engine (kvctl's plugins loaded, CPU + disk tiers, chunk 256) holds the
first half of the prompt; the route is asked about all 128K tokens (512 chunks). Median of 20
requests, end to end over HTTP on 127.0.0.1 (JSON encoding of 128K token ids included). The last
line is the figure.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import free_port, http_json, start_standalone_engine, stop_process, wait_until  # noqa: E402

TOKENS = 128 * 1024
RUNS = 20


def main() -> None:
    from kvctl.clients.internal_api import InternalAPIClient

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        port_start = free_port()
        subprocess.run([str(Path(sys.executable).parent / "kvctl"), "-q", "config", "init", "--out", str(root / "cfg"),
                        "--tier", "cpu:1", "--tier", f"disk:{root}/disk:1", "--internal-api-port-start",
                        str(port_start)], check=True, stdout=subprocess.DEVNULL)
        log = root / "engine.log"
        proc = start_standalone_engine(root / "cfg", log)
        url = f"http://127.0.0.1:{port_start + 1}"
        try:
            wait_until(lambda: http_json("GET", f"{url}/lmc_version"), 120, "standalone engine", proc, log)
            http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"0,{TOKENS // 2}"})
            prompt = list(range(TOKENS))
            with InternalAPIClient(url, timeout=60) as client:
                result = client.lookup(prompt)
                assert result["hit_tokens"]["total"] == TOKENS // 2 and len(result["chunks"]) == TOKENS // 256
                times = []
                for _ in range(RUNS):
                    start = time.perf_counter()
                    client.lookup(prompt)
                    times.append(time.perf_counter() - start)
        finally:
            stop_process(proc)
    median = statistics.median(times) * 1000
    print(f"route lookup, {TOKENS} tokens ({TOKENS // 256} chunks, half cached): median {median:.1f} ms, "
          f"best {min(times) * 1000:.1f} ms over {RUNS} requests")
    print(f"route_lookup_128k_ms={median:.1f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
