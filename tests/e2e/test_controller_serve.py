"""Two `kvctl serve` nodes on vLLM CPU registered with LMCache's controller, which the first one starts:
a prompt prewarmed on node A; `kvctl lookup --instance controller://…` names A with its hit tokens (no
inventory anywhere); a verified live copy moves the prompt to B, whose greedy completion then equals A's
and whose LMCache retrieves the copied tokens. A snapshot file moves another prompt the same way: saved
through A's engine, loaded through B's (its own configuration and disk directory, never asked the prompt;
the same --model value, which is part of every key)."""

import json
import time

import pytest

from tests.e2e.test_serve import MAX_TOKENS, Serve, answer, greedy, prompt_file, retrieve_hit_tokens
from tests.helpers import free_port, run_kvctl, wait_until

CHUNK = 256
SYNCED = "Exiting freeze mode after full sync"  # LMCache's log line once a registered engine stores again


def wait_synced(cache, name: str) -> None:
    """An engine that registers with a freshly started controller freezes (stores nothing) for a full sync
    of its keys, for up to ~10 s: wait until its log says it is over (or, 20 s on, that none began)."""
    log = cache / "serve" / name / "logs" / "vllm.log"
    since = time.monotonic()

    def synced() -> bool:
        text = log.read_text(errors="replace") if log.exists() else ""
        return SYNCED in text or ("full sync command" not in text and time.monotonic() - since > 20)

    wait_until(synced, 120, f"{name}'s full sync")


@pytest.mark.slow
def test_a_warm_prompt_is_found_through_the_controller_copied_verified_and_moved_by_snapshot(tmp_path, tiny_model):
    prompt = prompt_file(tmp_path)
    snapped, snap = prompt_file(tmp_path, "json/__init__"), tmp_path / "warm.kvsnap"
    controller_port = free_port(span=4)
    controller = f"controller://127.0.0.1:{controller_port}"
    node_a = Serve(tmp_path / "node-a", "--controller", "--controller-port", str(controller_port), "--name", "a",
                   model=tiny_model)
    node_b = None
    try:
        model = node_a.state["model"]
        wait_synced(tmp_path / "node-a", "a")
        uncached = greedy(node_a, prompt.read_text())
        assert len(uncached) == MAX_TOKENS
        chunks = len(answer(node_a, "lookup", "--prompt-file", prompt)["chunks"])
        wait_until(lambda: answer(node_a, "lookup", "--prompt-file", prompt)["hit_tokens"]["total"] == chunks * CHUNK,
                   60, "node A to cache the prompt")
        uncached_snapped = greedy(node_a, snapped.read_text())
        snapped_chunks = len(answer(node_a, "lookup", "--prompt-file", snapped)["chunks"])
        wait_until(lambda: answer(node_a, "lookup", "--prompt-file", snapped)["hit_tokens"]["total"]
                   == snapped_chunks * CHUNK, 60, "node A to cache the prompt to snapshot")
        saved = answer(node_a, "snapshot", "save", "--prompt-file", snapped, "-o", snap)
        assert saved["chunks"] == snapped_chunks >= 2 and saved["missing"] == 0
        node_b = Serve(tmp_path / "node-b", model, "--controller-url", f"127.0.0.1:{controller_port}", "--name", "b")
        wait_synced(tmp_path / "node-b", "b")

        def routed():
            result = run_kvctl("lookup", "--prompt-file", prompt, "--instance", controller, "--format", "json",
                               cwd=tmp_path)
            return json.loads(result.stdout) if result.stdout else None

        last: list = []

        def both_answer():
            found = routed()
            last[:] = [found]
            return found if found and len(found["instances"]) == 2 and all(
                "hit_tokens" in entry for entry in found["instances"]) else None

        try:
            report = wait_until(both_answer, 120, "both nodes registered and answering")
        except AssertionError:
            raise AssertionError(json.dumps(last[0])[:3000]) from None
        hits = {entry["instance"]: entry["hit_tokens"]["total"] for entry in report["instances"]}
        assert hits == {"kvctl-a": chunks * CHUNK, "kvctl-b": 0}
        assert report["routing"]["best"] == {"instance": "kvctl-a", "hit_tokens": chunks * CHUNK}

        copied = run_kvctl("snapshot", "copy", "--from", node_a.state["endpoints"]["internal_api"][1], "--to",
                           node_b.state["endpoints"]["internal_api"][1], "--prompt-file", prompt, "--format", "json")
        assert copied.code == 0, copied.stderr
        result = json.loads(copied.stdout)
        assert result["verified"] == result["chunks"] == chunks and result["mismatched"] == []
        hits_before = retrieve_hit_tokens(node_b)
        assert greedy(node_b, prompt.read_text()) == uncached
        wait_until(lambda: retrieve_hit_tokens(node_b) >= hits_before + chunks * CHUNK, 60, "B's retrieve hits")

        assert node_b.state["config_dir"] != node_a.state["config_dir"]
        assert answer(node_b, "lookup", "--prompt-file", snapped)["hit_tokens"]["total"] == 0
        loaded = answer(node_b, "snapshot", "load", snap)
        assert loaded["written"] == {"cpu": snapped_chunks}
        assert loaded["prompts"][0]["cached"] == snapped_chunks
        assert loaded["prompts"][0]["hit_tokens"] == snapped_chunks * CHUNK
        assert answer(node_b, "lookup", "--prompt-file", snapped)["hit_tokens"]["total"] == snapped_chunks * CHUNK
        hits_before = retrieve_hit_tokens(node_b)
        assert greedy(node_b, snapped.read_text()) == uncached_snapped
        wait_until(lambda: retrieve_hit_tokens(node_b) >= hits_before + snapped_chunks * CHUNK, 60,
                   "B's retrieve hits of the snapshot")
        assert node_b.stop() == 0
        assert node_a.stop() == 0  # the controller it started is stopped last, with it
    finally:
        for node in (node_b, node_a):
            if node is not None and node.proc.poll() is None:
                node.stop()
    for node in (node_a, node_b):
        node.assert_nothing_left()
