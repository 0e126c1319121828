"""How fast kvctl starts: `--help` and completion against the framework floor and `lmcache --help`.

Ratios of medians from one run. The framework floor is the `--help` of a minimal two-command
Typer app in the same virtual environment. Goals (issue: foundation): kvctl --help <= 1.25x the
floor; >= 10x faster than `lmcache --help`; static bash completion of `kvctl confi<TAB>` < 20 ms;
a dynamic completion call <= 1.25x the floor. The last line holds all four figures.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FLOOR_APP = '''
import typer

app = typer.Typer()


@app.command()
def hello(name: str) -> None:
    print(name)


@app.command()
def bye(name: str) -> None:
    print(name)


if __name__ == "__main__":
    app()
'''


def median_seconds(argv: list[str], runs: int, env: dict | None = None) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                       env={**os.environ, **(env or {})})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bash_completion_ms(calls: int = 200) -> float:
    """Median time of one `kvctl confi<TAB>` in a bash that has sourced completions/kvctl.bash."""
    script = f"""
source {REPO / "completions" / "kvctl.bash"}
COMP_WORDS=(kvctl confi); COMP_CWORD=1
for ((n = 0; n < {calls}; n++)); do
    start=$EPOCHREALTIME; _kvctl_complete; end=$EPOCHREALTIME
    echo "$start $end"
done
[[ ${{COMPREPLY[*]}} == config ]] || exit 3
"""
    done = subprocess.run([shutil.which("bash"), "--norc", "-c", script], capture_output=True, text=True, check=True,
                          env={"PATH": "/nonexistent", "LC_ALL": "C"})
    spans = [float(end) - float(start) for start, end in (line.split() for line in done.stdout.splitlines())]
    return statistics.median(spans) * 1000


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        floor_app = Path(folder) / "floor.py"
        floor_app.write_text(FLOOR_APP)
        python = str(BIN / "python")
        for warm in ([python, str(floor_app), "--help"], [str(BIN / "kvctl"), "--help"]):
            subprocess.run(warm, stdout=subprocess.DEVNULL, check=True)
        floor = median_seconds([python, str(floor_app), "--help"], 15)
        kvctl_help = median_seconds([str(BIN / "kvctl"), "--help"], 15)
        dynamic = median_seconds([str(BIN / "kvctl"), "complete-values", "models", ""], 15)
        lmcache_help = median_seconds([str(BIN / "lmcache"), "--help"], 3, env={"LMCACHE_DISABLE_BANNER": "1",
                                                                                 "LMCACHE_TRACK_USAGE": "false"})
    static_ms = bash_completion_ms()
    print(f"framework floor (2-command Typer app --help): {floor * 1000:.0f} ms")
    print(f"kvctl --help: {kvctl_help * 1000:.0f} ms = {kvctl_help / floor:.2f}x the floor (goal <= 1.25x)")
    print(f"lmcache --help: {lmcache_help * 1000:.0f} ms = {lmcache_help / kvctl_help:.1f}x slower than kvctl "
          "(goal >= 10x)")
    print(f"bash static completion 'kvctl confi<TAB>': {static_ms:.2f} ms (goal < 20 ms)")
    print(f"dynamic completion call: {dynamic * 1000:.0f} ms = {dynamic / floor:.2f}x the floor (goal <= 1.25x)")
    print(f"help_vs_floor={kvctl_help / floor:.2f}x lmcache_vs_kvctl={lmcache_help / kvctl_help:.1f}x "
          f"static_completion_ms={static_ms:.2f} dynamic_completion_vs_floor={dynamic / floor:.2f}x")


if __name__ == "__main__":
    main()
