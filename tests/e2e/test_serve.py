"""`kvctl serve` on the embedded default, `kvctl prewarm` and `kvctl lookup` against it, restarts,
nothing left running after a stop, a kill of kvctl, or the death of a child; readiness on IPv6 loopback
that no proxy can fake, a pin set applied once ready, statistics through a real vLLM scheduler, vLLM's own
tokenization, a start that fails within seconds, MP pins through the coordinator serve starts, and an MP
snapshot that moves a warm prompt to a node that never saw it.

A vLLM start costs ~30 CPU-s: each test here asks one serve as much as it can (tests that only read from a
serve share it in a class), and a node is added only where a check needs another process."""

import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

from kvctl.core.lmcache.tokens import LocalTokenizer
from tests.helpers import (
    KVCTL,
    REPO,
    default_signals,
    free_port,
    http_client,
    proxy_answering_200,
    run_kvctl,
    wait_until,
)
from tests.integration.test_serve_readiness import started_child


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Serve:
    """`kvctl serve` in a child process, with its own kvctl cache directory. `model`, the session's tiny
    model, is copied where serve would build it (the build is tested by test_make_run_ends_cleanly_on_ctrl_c).
    Without --tier or --config, the default tiers (CPU and serve's own disk directory) with a CPU tier of
    0.1 GB instead of a fifth of the free RAM: three serves at once would otherwise hold up to 15 GB of this
    24 GB machine (an MP server touches all of its L1 at start), and the kernel's reclaim showed as 40-80 %
    system CPU; LMCache also takes ~6 CPU-s per GB to set a CPU tier up. The default size itself is
    platform.default_cpu_tier_gb's (unit-tested), and `make run`'s test serves with it."""

    def __init__(self, cache, *args, ready=True, model=None):
        if "--tier" not in args and "--config" not in args:
            name = args[args.index("--name") + 1] if "--name" in args else "default"
            args = ("--tier", "cpu:0.1", "--tier", f"disk:{cache / 'serve' / name / 'disk'}", *args)
        self.env = {**os.environ, "KVCTL_CACHE_DIR": str(cache)}
        self.state_file = cache / "serve" / "state.json"
        self.port, self.api, self.mp_http, self.coordinator = free_port(), free_port(), free_port(), free_port()
        cache.mkdir(parents=True, exist_ok=True)
        if model is not None and not (cache / "models" / "tiny").exists():
            shutil.copytree(model, cache / "models" / "tiny")
        self.stderr = cache / f"serve-{time.monotonic_ns()}.err"
        argv = [str(KVCTL), "serve", "--port", str(self.port), "--internal-api-port-start", str(self.api),
                "--mp-port", str(free_port()), "--mp-http-port", str(self.mp_http), "--coordinator-port",
                str(self.coordinator), *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.stderr.open("w"), env=self.env,
                                     preexec_fn=default_signals)
        if ready:
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


MAX_TOKENS = 12


def greedy(serve: Serve, prompt: str) -> list[int]:
    """The served model's greedy completion of a prompt, token by token."""
    body = {"model": serve.state["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1}
    answer = http_client().post(f"{serve.state['endpoints']['vllm']}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["tokens"]


def answer(serve: Serve, *args) -> dict:
    result = serve.kvctl(*args, "--format", "json")
    assert result.code == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def stats(serve: Serve) -> dict:
    return answer(serve, "stats")["instances"][0]


def retrieve_hit_tokens(serve: Serve) -> int:
    return stats(serve)["lmcache"]["retrieve"]["hit_tokens"] or 0


def complete(serve: Serve, prompt) -> None:
    """One token of a completion: the prompt's KV is what the request is for."""
    body = {"model": serve.state["model"], "prompt": prompt, "max_tokens": 1}
    answered = http_client().post(f"{serve.state['endpoints']['vllm']}/v1/completions", json=body, timeout=120)
    assert answered.status_code == 200, answered.text


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

    wait_until(lambda: (stats(serve)["lmcache"]["store"]["tokens"] or 0) >= chunks * 256, 60,
               "LMCache's store metrics")
    report = stats(serve)
    assert report["vllm"]["prompt_tokens"] >= prompt_tokens
    tiers = {tier["tier"]: tier for tier in report["lmcache"]["tiers"]}
    assert tiers["cpu"]["chunks"] >= chunks and tiers["disk"]["chunks"] >= chunks
    listed = json.loads(serve.kvctl("ls", "--format", "json").stdout)
    assert {tier["tier"]: tier["total"] >= chunks for tier in listed["tiers"]} == {"cpu": True, "disk": True}
    frame = serve.kvctl("top", "--once", "--format", "json")
    assert frame.code == 0 and json.loads(frame.stdout)["health"]["healthy"]


def assert_state_and_config_name_the_running_instance(serve, prompt, chunks, tmp_path):
    """--state with its serve's --config acts on the running instance (one decision of both selectors);
    another configuration beside it is a contradiction, refused."""
    both = ["--state", serve.state_file, "--config", serve.state["config_dir"], "--format", "json"]
    listed = serve.kvctl("ls", *both)
    assert listed.code == 0, listed.stderr
    assert {tier["tier"]: tier["total"] >= chunks for tier in json.loads(listed.stdout)["tiers"]}.get("cpu")
    found = serve.kvctl("lookup", "--prompt-file", prompt, *both)  # the model comes from the state
    assert found.code == 0 and json.loads(found.stdout)["hit_tokens"]["total"] == chunks * 256, found.stderr
    planned = serve.kvctl("evict", "--prompt-file", prompt, "--tier", "cpu", "--dry-run", *both)
    assert planned.code == 0 and json.loads(planned.stdout)["removed"]["cpu"] == chunks, planned.stderr
    other = tmp_path / "other-config"
    assert serve.kvctl("config", "init", "--out", other).code == 0
    refused = serve.kvctl("ls", "--state", serve.state_file, "--config", other)
    assert refused.code == 2 and "runs with" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_serve_prewarm_lookup_restart_stop_inprocess(tmp_path, tiny_model):
    cache = tmp_path / "kvctl-cache"
    prompt = prompt_file(tmp_path)
    serve = Serve(cache, model=tiny_model)
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
        assert_state_and_config_name_the_running_instance(serve, prompt, entry["chunks"], tmp_path)
        assert serve.stop() == 0
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    serve.assert_nothing_left()

    again = Serve(cache)  # same configuration and disk tier: the prompt now hits LMCache from disk
    try:
        complete(again, prompt.read_text())
        log = again.state["processes"][0]["log"]
        wait_until(lambda: re.search(r"LMCache hit tokens: [1-9]", open(log).read()), 30, "an LMCache hit")
    finally:
        again.proc.kill()  # SIGKILL: kvctl cannot clean up, its children must still go
    wait_until(lambda: not any(group_alive(pid) for pid in again.pids), 90, "children gone after SIGKILL")


@pytest.mark.slow
def test_make_run_ends_cleanly_on_ctrl_c(tmp_path):
    """The README's main job on a terminal, stopped the normal way: Ctrl-C to the whole foreground group
    (make, the script, kvctl). The last thing a user sees is kvctl's stop, not make's "Error 130"."""
    cache = tmp_path / "kvctl-cache"
    ports = f"--port {free_port()} --internal-api-port-start {free_port()}"
    leader, follower = pty.openpty()
    proc = subprocess.Popen(["make", "--no-print-directory", "run", f"ARGS={ports}"], cwd=REPO, stdin=follower,
                            stdout=follower, stderr=follower, start_new_session=True, preexec_fn=default_signals,
                            env={**os.environ, "KVCTL_CACHE_DIR": str(cache), "COLUMNS": "120"})
    os.close(follower)
    output, state = b"", cache / "serve" / "state.json"
    try:
        deadline = time.monotonic() + 600
        while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
            output += read_available(leader)
        assert state.exists(), output.decode(errors="replace")[-3000:]
        pids = [process["pid"] for process in json.loads(state.read_text())["processes"]]
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)
        output += read_available(leader)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        os.close(leader)
    text = output.decode(errors="replace")
    # make, signalled itself, waits for kvctl and then dies of SIGINT as it must: a shell prints nothing for that
    assert proc.returncode == -signal.SIGINT, text[-3000:]
    assert "Error" not in text and "Traceback" not in text, text[-3000:]
    assert "stopped default" in text.strip().splitlines()[-1], text[-3000:]
    wait_until(lambda: not any(group_alive(pid) for pid in pids), 60, "children gone")


def read_available(leader: int) -> bytes:
    """What the terminal shows within half a second (nothing once the other side is closed)."""
    try:
        return os.read(leader, 65536) if select.select([leader], [], [], 0.5)[0] else b""
    except OSError:
        return b""


@pytest.mark.slow
def test_serve_mp_prewarm_lookup_restart_and_snapshot_to_a_new_node(tmp_path, tiny_model):
    """Prewarm and lookup on an MP serve; a restart gets the prompt back from its fs L2 tier; a snapshot of
    another prompt, saved from the first serve's L1, moves to a node that never saw it (its own configuration
    and disk directory, the same --model value, which is part of every key): written into that node's L1
    through its server (whose vLLM registered the model's layout), then retrieved by its vLLM."""
    cache = tmp_path / "kvctl-cache"
    prompt = prompt_file(tmp_path, "json/__init__")
    moved, snap = prompt_file(tmp_path), tmp_path / "warm-mp.kvsnap"
    serve = Serve(cache, "--mode", "mp", model=tiny_model)
    try:
        assert [process["name"] for process in serve.state["processes"]] == ["lmcache-coordinator", "lmcache-server",
                                                                            "vllm"]
        warmed = serve.kvctl("prewarm", prompt, "--format", "json")
        assert warmed.code == 0, warmed.stderr
        entry = json.loads(warmed.stdout)["prompts"][0]
        assert entry["chunks"] >= 2 and entry["cached_chunks"] == entry["chunks"] and entry["tiers"] == ["cpu", "disk"]
        status = http_client().get(f"{serve.state['endpoints']['mp_http']}/status", timeout=10).json()
        assert status["storage_manager"]["l1_managers"]["_default"]["total_object_count"] >= entry["chunks"]
        health = json.loads(serve.kvctl("health", "--format", "json").stdout)
        checks = {check["component"]: check["ok"] for check in health["instances"][0]["checks"]}
        assert checks == {"vllm": True, "mp_server": True, "coordinator": True, "disk": True}
        assert_state_and_config_name_the_running_instance(serve, prompt, entry["chunks"], tmp_path)
        lmcache = stats(serve)["lmcache"]
        assert lmcache["lookup"]["tokens"] >= entry["chunks"] * 256  # vLLM asked the server for its full chunks
        assert lmcache["tiers"][0]["tier"] == "cpu" and lmcache["tiers"][0]["chunks"] >= entry["chunks"]
        uncached = greedy(serve, moved.read_text())  # the first request of this prompt: nothing was cached yet
        chunks = len(answer(serve, "lookup", "--prompt-file", moved)["chunks"])
        wait_until(lambda: answer(serve, "lookup", "--prompt-file", moved)["hit_tokens"]["cpu"] == chunks * 256,
                   60, "the L1 to hold the prompt")
        saved = answer(serve, "snapshot", "save", "--prompt-file", moved, "-o", snap)
        assert saved["chunks"] >= chunks >= 2 and saved["missing"] == 0
        assert answer(serve, "snapshot", "ls", snap)["source"]["key_format"] == "mp-object"
        assert serve.stop(signal.SIGINT) == 0  # Ctrl-C is how a server is stopped: not a failure
        assert "stopped" in serve.stderr.read_text()
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    serve.assert_nothing_left()

    again = Serve(cache, "--mode", "mp")  # a new server and vLLM: the prompt comes back from the fs L2 tier
    try:
        complete(again, prompt.read_text())
        logs = {process["name"]: process["log"] for process in again.state["processes"]}
        wait_until(lambda: re.search(r"Retrieved [1-9]\d* tokens", open(logs["lmcache-server"]).read()
                                     + open(logs["vllm"]).read()), 30, "a retrieve from LMCache")
        assert_pins_go_through_the_coordinator(again, tmp_path)
        assert again.stop() == 0
    finally:
        if again.proc.poll() is None:
            again.stop()
    stopping = [line for line in again.stderr.read_text().splitlines() if line.startswith("stopping ")]
    assert stopping == ["stopping vllm", "stopping lmcache-server", "stopping lmcache-coordinator"]
    again.assert_nothing_left()

    node_b = Serve(tmp_path / "node-b", again.state["model"], "--mode", "mp")
    try:
        assert answer(node_b, "lookup", "--prompt-file", moved)["hit_tokens"]["total"] == 0
        loaded = answer(node_b, "snapshot", "load", snap)
        assert loaded["written"] == {"cpu": saved["chunks"]} and loaded["prompts"][0]["cached"] == chunks
        assert answer(node_b, "lookup", "--prompt-file", moved)["hit_tokens"]["cpu"] == chunks * 256
        assert greedy(node_b, moved.read_text()) == uncached
        server_log = {process["name"]: process["log"] for process in node_b.state["processes"]}["lmcache-server"]
        wait_until(lambda: f"Retrieved {chunks * 256} tokens" in Path(server_log).read_text(), 60,
                   "node B's vLLM to retrieve the loaded chunks")
        assert node_b.stop() == 0
    finally:
        if node_b.proc.poll() is None:
            node_b.stop()
    node_b.assert_nothing_left()


def assert_pins_go_through_the_coordinator(serve, tmp_path):
    """The coordinator MP serve starts has its server registered, and pins go through it (no --coordinator)."""
    coordinator = serve.state["endpoints"]["coordinator"]
    assert coordinator == f"http://127.0.0.1:{serve.coordinator}"
    registered = http_client().get(f"{coordinator}/instances", timeout=10).json()["instances"]
    assert [(server["ip"], server["http_port"]) for server in registered] == [("127.0.0.1", serve.mp_http)]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([(7 * i) % 1000 + 3 for i in range(2 * 256)]))
    pinned = serve.kvctl("pin", "--tokens-file", tokens, "--format", "json")
    assert pinned.code == 0, pinned.stderr
    assert json.loads(pinned.stdout) == {"model": serve.state["model"], "requested": 2, "affected": 2,
                                         "status": "pinned"}
    pins = json.loads(serve.kvctl("pins", "--format", "json").stdout)["pins"]
    assert len(pins) == 2 and all(pin["pin_count"] == 1 and pin["key"].startswith(serve.state["model"] + "@")
                                  for pin in pins)
    unpinned = serve.kvctl("unpin", "--tokens-file", tokens, "--format", "json")
    assert unpinned.code == 0 and json.loads(unpinned.stdout)["status"] == "unpinned", unpinned.stderr
    assert json.loads(serve.kvctl("pins", "--format", "json").stdout) == {"pins": []}


PROMPT = "def greet(name):\n    return f'Hello, {name}!'  # ünïcödé too\n" * 20
CHAT = [{"role": "system", "content": "You answer in Python."}, {"role": "user", "content": "Sort a list."}]


@pytest.fixture(scope="class")
def ipv6(tmp_path_factory, tiny_model):
    """One serve on IPv6 loopback, with a proxy that answers 200 to everything set in the environment; a pin
    set (`--pins`); a configuration that records chunk statistics (file_hash, into the directory yielded);
    vLLM's own prefix cache off, so every repeat of a prefix goes to LMCache."""
    directory = tmp_path_factory.mktemp("ipv6")
    config, hashes, pins = directory / "cfg", directory / "chunk-hashes", directory / "pins.yaml"
    made = run_kvctl("config", "init", "--out", config, "--tier", "cpu:0.1", "--tier", f"disk:{directory / 'disk'}:1")
    assert made.code == 0, made.stderr
    settings = yaml.safe_load((config / "lmcache.yaml").read_text())
    settings.update(enable_chunk_statistics=True, chunk_statistics_auto_start_statistics=True,
                    chunk_statistics_strategy="file_hash")
    settings.setdefault("extra_config", {})["chunk_statistics_file_output_dir"] = str(hashes)
    (config / "lmcache.yaml").write_text(yaml.safe_dump(settings))
    pins.write_text(f"name: boot\npins:\n  - prompt_file: {prompt_file(directory).name}\n    ttl: 1h\n")
    with pytest.MonkeyPatch.context() as monkeypatch, proxy_answering_200(monkeypatch) as proxied:
        serve = Serve(directory / "kvctl-cache", "--host", "::1", "--config", config, "--pins", pins, "--",
                      "--no-enable-prefix-caching", model=tiny_model)
        serve.pin_set = pins
        try:
            yield serve, proxied, hashes
        finally:
            if serve.proc.poll() is None:
                serve.stop()
            serve.assert_nothing_left()


@pytest.mark.slow
class TestOneServeOnIPv6Loopback:
    """Checks that only read from a running serve (or add their own traffic) share one: a vLLM start costs
    ~30 CPU-s. The last test ends it.

    Statistics go through a real vLLM scheduler: LMCache's chunk statistics and doctor's retrieve check
    (`chunk-stats top` counts both requests of a repeated prompt; doctor finds the connector retrieving what
    the lookups found), and `kvctl stats` at once after a real client's traffic agrees with vLLM (#20 item
    16: LMCache exports its counters to /metrics every 10 s while vLLM's move with each request, so stats
    that read /metrics showed no LMCache lookups, retrieves or stores while vLLM counted LMCache's hits)."""

    def test_serve_on_ipv6_loopback_is_ready_when_vllm_is_not_when_a_proxy_says_so(self, ipv6):
        serve, proxied, _ = ipv6
        vllm = f"http://[::1]:{serve.port}"
        assert serve.state["endpoints"]["vllm"] == vllm
        models = http_client().get(f"{vllm}/v1/models", timeout=10).json()["data"]
        assert [model["id"] for model in models] == [serve.state["model"]]
        assert "waiting for vLLM, LMCache's scheduler API, LMCache's worker 0 API" in serve.stderr.read_text()
        assert serve.kvctl("health").code == 0
        assert proxied == []  # the proxy answering 200 to everything was never asked

    def test_token_ids_equal_vllm_tokenize(self, ipv6, tiny_model):
        """kvctl tokenizes prompts and chats exactly as the served vLLM does for the same request."""
        serve, _, _ = ipv6
        tokenize = f"{serve.state['endpoints']['vllm']}/tokenize"
        tokenizer = LocalTokenizer(tiny_model)
        served = http_client().post(tokenize, json={"model": serve.state["model"], "prompt": PROMPT}, timeout=30).json()
        assert served["tokens"] == tokenizer.encode_prompt(PROMPT)
        assert served["tokens"][0] == tokenizer.tokenizer.bos_token_id
        chat = http_client().post(tokenize, json={"model": serve.state["model"], "messages": CHAT}, timeout=30).json()
        assert chat["tokens"] == tokenizer.encode_chat(CHAT)
        assert json.dumps(chat["tokens"]) != json.dumps(served["tokens"])

    def test_the_pin_set_is_prefilled_and_pinned_once_ready(self, ipv6):
        """Once every part is ready, serve applies its pin set: the prompt prefilled through vLLM (nothing was
        cached), then pinned whole under the set's id; applying the set again only refreshes that pin."""
        serve, proxied, _ = ipv6

        def listed():
            result = serve.kvctl("pins", "--format", "json")
            return result.code == 0 and json.loads(result.stdout)["pins"]

        (pin,) = wait_until(listed, 120, "the pin set applied")
        assert pin["set"] == "boot" and pin["pin_id"].startswith("set-boot-") and pin["chunks"] >= 2
        assert pin["pinned"] == {"cpu": pin["chunks"], "disk": pin["chunks"]}  # prefilled, then pinned whole
        assert 3000 < pin["ttl_remaining_s"] <= 3600
        wait_until(lambda: "pin set boot: 1 pin" in serve.stderr.read_text(), 30, "the pin set reported")
        (step,) = answer(serve, "pin", "apply", serve.pin_set)["steps"]
        assert (step["action"], step["pin_id"], step["prewarm"]) == ("refresh", pin["pin_id"], None)
        assert proxied == []

    def test_a_repeated_prompt_is_the_hottest_and_doctor_sees_it_retrieved(self, ipv6, tmp_path):
        serve, proxied, hashes = ipv6
        prompt = prompt_file(tmp_path, "json/__init__")  # not the pin set's, which was prefilled once
        for _ in range(2):
            complete(serve, prompt.read_text())
        wait_until(lambda: stats(serve)["lmcache"]["retrieve"]["hit_tokens"], 60, "LMCache's retrieve metrics")
        lmcache = stats(serve)["lmcache"]
        assert lmcache["lookup"]["hit_tokens"] >= 256 and lmcache["retrieve"]["hit_tokens"] >= 256

        hot = answer(serve, "chunk-stats", "top")  # the directory is read from the engine
        assert hot["directory"] == str(hashes) and hot["requests"] >= 2 and hot["skipped_lines"] == 0
        found = answer(serve, "lookup", "--prompt-file", prompt)
        assert hot["prompts"][0]["requests"] == 2 and hot["prompts"][0]["chunks"] >= len(found["chunks"]) >= 2
        assert hot["chunks"][0]["requests"] == 2

        doctor = serve.kvctl("doctor", "--format", "json")
        findings = json.loads(doctor.stdout)["findings"]
        assert not [finding for finding in findings if finding["check"] == "retrieve"], findings
        assert doctor.code == 0, findings
        assert proxied == []

    def test_stats_right_after_traffic_count_what_vllm_counts(self, ipv6):
        """What this test's requests added, read at once: the counters before it are its baseline. Prompts as
        token ids, so the prefix is exactly two chunks."""
        serve, _, _ = ipv6
        prefix = [100 + i % 900 for i in range(2 * 256)]
        start = stats(serve)

        def added(report, *path):
            now, before = report, start
            for key in path:
                now, before = now[key], before[key]
            return now - (before or 0)

        requests = 0
        for _round in range(2):  # twice: LMCache's figures must move with the traffic, not with an export
            for _ in range(2):
                requests += 1
                complete(serve, prefix + [1000 + requests] * 8)
            report = stats(serve)
            lmcache, hits = report["lmcache"], added(report, "vllm", "external_cache", "hits")
            assert hits == (requests - 1) * 2 * 256  # every request but the first: the prefix
            assert lmcache["retrieve"]["source"] == lmcache["store"]["source"] == "live"
            assert added(report, "lmcache", "retrieve", "hit_tokens") == hits, report
            assert added(report, "lmcache", "lookup", "requests") >= requests
            assert added(report, "lmcache", "lookup", "hit_tokens") >= hits
            assert added(report, "lmcache", "store", "requests") >= 1
            assert added(report, "lmcache", "store", "tokens") >= 2 * 256

    def test_serve_exits_with_the_log_when_a_child_dies(self, ipv6):
        serve, proxied, _ = ipv6
        os.killpg(serve.pids[0], signal.SIGKILL)
        serve.proc.wait(60)
        assert serve.proc.returncode == 1
        stderr = serve.stderr.read_text()
        assert "error: vllm exited with code" in stderr and "hint: the whole log is" in stderr
        serve.assert_nothing_left()
        assert proxied == []


@pytest.mark.slow
def test_serve_reports_a_worker_api_that_cannot_bind_within_seconds(tmp_path, tiny_model):
    serve = Serve(tmp_path / "kvctl-cache", ready=False, model=tiny_model)
    log = tmp_path / "kvctl-cache" / "serve" / "default" / "logs" / "vllm.log"
    try:
        vllm = wait_until(lambda: started_child(serve.proc.pid, "vllm.entrypoints"), 60, "vLLM started")
        with socket.socket() as taken:  # after the preflight, before LMCache's worker 0 binds it
            taken.bind(("127.0.0.1", serve.api + 1))
            taken.listen()
            wait_until(lambda: "address already in use" in log.read_text(), 300, "LMCache's bind error")
            seen = time.monotonic()
            serve.proc.wait(60)
        took = time.monotonic() - seen
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    stderr = serve.stderr.read_text()
    assert serve.proc.returncode == 1 and took < 15, (took, stderr)
    assert re.search(r"error: vllm failed while starting: ERROR: +\[Errno 98\] .*address already in use", stderr)
    assert "its last log lines:" in stderr and "hint: the whole log is" in stderr and "Traceback" not in stderr.split(
        "error:")[0]
    wait_until(lambda: not group_alive(vllm), 30, "vLLM stopped")
