"""The schema snapshot kvctl ships must equal what the installed LMCache defines."""

import json
import subprocess
import sys

from tests.helpers import REPO, STACK_ENV


def test_snapshot_matches_installed_lmcache():
    code = "import json; from kvctl.core.lmcache.schema import extract_schema; print(json.dumps(extract_schema()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**__import__("os").environ, **STACK_ENV, "LMCACHE_LOG_LEVEL": "ERROR"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    live = json.loads(done.stdout.strip().splitlines()[-1])
    shipped = json.loads((REPO / "kvctl" / "core" / "lmcache" / "schema.json").read_text())
    assert live == shipped, "run scripts/gen-lmcache-schema to refresh kvctl/core/lmcache/schema.json"
    assert len(live["inprocess"]["keys"]) == 108
