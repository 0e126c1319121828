"""`kvctl serve` on the embedded default, `kvctl prewarm` and `kvctl lookup` against it, restarts,
and nothing left running after a stop, a kill of kvctl, or the death of a child."""

import json
import os
import re
import signal
import subprocess
import sysconfig
import time

import httpx
import pytest

from tests.helpers import KVCTL, free_port, run_kvctl, wait_until


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Serve:
    """`kvctl serve` in a child process, with its own kvctl cache directory."""

    def __init__(self, cache, *args):
        self.env = {**os.environ, "KVCTL_CACHE_DIR": str(cache)}
        self.state_file = cache / "serve" / "state.json"
        self.port, self.api = free_port(), free_port()
        cache.mkdir(parents=True, exist_ok=True)
        self.stderr = cache / f"serve-{time.monotonic_ns()}.err"
        argv = [str(KVCTL), "serve", "--port", str(self.port), "--internal-api-port-start", str(self.api),
                "--mp-port", str(free_port()), "--mp-http-port", str(free_port()), *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.stderr.open("w"), env=self.env)
        wait_until(lambda: self.state_file.exists() or self.proc.poll() is not None, 600, "kvctl serve")
        assert self.proc.poll() is None, self.stderr.read_text()[-3000:]
        self.state = json.loads(self.state_file.read_text())
        self.pids = [process["pid"] for process in self.state["processes"]]

    def kvctl(self, *args):
        return run_kvctl(*args, env=self.env)

    def stop(self, signum=signal.SIGTERM, timeout=90):
        self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode

    def assert_nothing_left(self, timeout=60):
        wait_until(lambda: not any(group_alive(pid) for pid in self.pids), timeout, "children gone")
        assert not self.state_file.exists() and not (self.state_file.parent / "default" / "state.json").exists()


def prompt_file(tmp_path, module="csv"):
    path = tmp_path / f"{module.replace('/', '_')}.txt"
    path.write_text(open(f"{sysconfig.get_paths()['stdlib']}/{module}.py").read()[:2500])
    return path


def assert_operator_views(serve, chunks, prompt_tokens):
    """health, stats, ls and top against a served instance (the most recent kvctl serve, found by default)."""
    health = serve.kvctl("health", "--format", "json")
    assert health.code == 0, health.stdout + health.stderr
    checks = {check["component"]: check for check in json.loads(health.stdout)["instances"][0]["checks"]}
    assert set(checks) == {"vllm", "internal_api (scheduler)", "internal_api (worker 0)", "offload", "disk"}
    assert all(check["ok"] for check in checks.values())

    def stats():
        result = serve.kvctl("stats", "--format", "json")
        assert result.code == 0, result.stderr
        return json.loads(result.stdout)["instances"][0]

    wait_until(lambda: (stats()["lmcache"]["store"]["tokens"] or 0) >= chunks * 256, 60, "LMCache's store metrics")
    report = stats()
    assert report["vllm"]["prompt_tokens"] >= prompt_tokens
    tiers = {tier["tier"]: tier for tier in report["lmcache"]["tiers"]}
    assert tiers["cpu"]["chunks"] >= chunks and tiers["disk"]["chunks"] >= chunks
    listed = json.loads(serve.kvctl("ls", "--format", "json").stdout)
    assert {tier["tier"]: tier["total"] >= chunks for tier in listed["tiers"]} == {"cpu": True, "disk": True}
    frame = serve.kvctl("top", "--once", "--format", "json")
    assert frame.code == 0 and json.loads(frame.stdout)["health"]["healthy"]


@pytest.mark.slow
def test_serve_prewarm_lookup_restart_stop_inprocess(tmp_path):
    cache = tmp_path / "kvctl-cache"
    prompt = prompt_file(tmp_path)
    serve = Serve(cache)
    try:
        assert serve.state["mode"] == "inprocess" and serve.state["model"].endswith("models/tiny")
        assert os.path.exists(serve.state["endpoints"]["offload_socket"])
        warmed = serve.kvctl("prewarm", prompt, "--format", "json")
        assert warmed.code == 0, warmed.stderr
        entry = json.loads(warmed.stdout)["prompts"][0]
        assert entry["error"] is None and entry["cached_chunks"] == entry["chunks"] == entry["prompt_tokens"] // 256
        assert entry["tiers"] == ["cpu", "disk"]
        found = json.loads(serve.kvctl("lookup", "--instance", "default", "--prompt-file", prompt, "--format",
                                       "json").stdout)
        assert found["hit_tokens"]["total"] == entry["chunks"] * 256 and found["tiers_checked"] == ["cpu", "disk"]
        assert_operator_views(serve, entry["chunks"], entry["prompt_tokens"])
        assert serve.stop() == 0
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    serve.assert_nothing_left()

    again = Serve(cache)  # same configuration and disk tier: the prompt now hits LMCache from disk
    try:
        body = {"model": again.state["model"], "prompt": prompt.read_text(), "max_tokens": 1}
        assert httpx.post(f"{again.state['endpoints']['vllm']}/v1/completions", json=body, timeout=120).status_code == 200
        log = again.state["processes"][0]["log"]
        wait_until(lambda: re.search(r"LMCache hit tokens: [1-9]", open(log).read()), 30, "an LMCache hit")
    finally:
        again.proc.kill()  # SIGKILL: kvctl cannot clean up, its children must still go
    wait_until(lambda: not any(group_alive(pid) for pid in again.pids), 90, "children gone after SIGKILL")


@pytest.mark.slow
def test_serve_exits_with_the_log_when_a_child_dies(tmp_path):
    serve = Serve(tmp_path / "kvctl-cache")
    try:
        os.killpg(serve.pids[0], signal.SIGKILL)
        serve.proc.wait(60)
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    assert serve.proc.returncode == 1
    stderr = serve.stderr.read_text()
    assert "error: vllm exited with code" in stderr and "hint: the whole log is" in stderr
    serve.assert_nothing_left()


@pytest.mark.slow
def test_serve_mp_prewarm_lookup(tmp_path):
    cache = tmp_path / "kvctl-cache"
    prompt = prompt_file(tmp_path, "json/__init__")
    serve = Serve(cache, "--mode", "mp")
    try:
        assert [process["name"] for process in serve.state["processes"]] == ["lmcache-server", "vllm"]
        warmed = serve.kvctl("prewarm", prompt, "--format", "json")
        assert warmed.code == 0, warmed.stderr
        entry = json.loads(warmed.stdout)["prompts"][0]
        assert entry["chunks"] >= 2 and entry["cached_chunks"] == entry["chunks"] and entry["tiers"] == ["cpu", "disk"]
        status = httpx.get(f"{serve.state['endpoints']['mp_http']}/status", timeout=10).json()
        assert status["storage_manager"]["l1_managers"]["_default"]["total_object_count"] >= entry["chunks"]
        health = json.loads(serve.kvctl("health", "--format", "json").stdout)
        checks = {check["component"]: check["ok"] for check in health["instances"][0]["checks"]}
        assert checks == {"vllm": True, "mp_server": True, "disk": True}
        stats = serve.kvctl("stats", "--format", "json")
        assert stats.code == 0, stats.stderr
        lmcache = json.loads(stats.stdout)["instances"][0]["lmcache"]
        assert lmcache["lookup"]["tokens"] >= entry["chunks"] * 256  # vLLM asked the server for its full chunks
        assert lmcache["tiers"][0]["tier"] == "cpu" and lmcache["tiers"][0]["chunks"] >= entry["chunks"]
        assert serve.stop(signal.SIGINT) == 130
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    serve.assert_nothing_left()

    again = Serve(cache, "--mode", "mp")  # a new server and vLLM: the prompt comes back from the fs L2 tier
    try:
        body = {"model": again.state["model"], "prompt": prompt.read_text(), "max_tokens": 1}
        assert httpx.post(f"{again.state['endpoints']['vllm']}/v1/completions", json=body, timeout=120).status_code == 200
        server_log = again.state["processes"][0]["log"]
        wait_until(lambda: re.search(r"Retrieved [1-9]\d* tokens", open(server_log).read()
                                     + open(again.state["processes"][1]["log"]).read()), 30, "a retrieve from LMCache")
        assert again.stop() == 0
    finally:
        if again.proc.poll() is None:
            again.stop()
    again.assert_nothing_left()
