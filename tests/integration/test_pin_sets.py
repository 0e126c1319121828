"""Pin sets against a real LMCache engine with kvctl's routes (CPU + disk tiers): `kvctl pin apply`
pins, refreshes and releases only its own pins, and re-pins after the engine restarts (its pins lived in
its memory); the hook `kvctl serve --pins` runs after every start is applied to the engine's state file."""

import json

import pytest

from kvctl.cli.serve import _apply_pins
from kvctl.core.pins import pinsets
from kvctl.output import Output
from tests.helpers import http_json, init_engine, tier_args, wait_until

CHUNK = 256
SET = "name: hot\npins:\n  - tokens_file: prompts/a.json\n    ttl: 10m\n  - tokens_file: prompts/b.json\n"
EDITED = "name: hot\npins:\n  - tokens_file: prompts/a.json\n    ttl: 1h\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pin-sets")
    with init_engine(root, *tier_args("cpu:0.1", f"disk:{root}/disk:1")) as started:
        yield started


def store(engine, name: str, start: int, chunks: int):
    """A prompt of `chunks` chunks stored in the engine (on the CPU and disk tiers), as a tokens file."""
    http_json("POST", f"{engine.url}/cache/store", params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    path = engine.root / "set" / "prompts" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(range(start, start + chunks * CHUNK))))
    wait_until(lambda: all(chunk["tiers"] == ["cpu", "disk"]
                           for chunk in engine.answer("lookup", "--tokens-file", path)["chunks"]), 30, "stored chunks")
    return path


def steps(answer) -> dict[str, tuple]:
    return {step.get("file", step["pin_id"]): (step["action"], step["cached_chunks"], step["chunks"])
            for step in answer["steps"]}


@pytest.mark.slow
def test_a_pin_set_is_applied_edited_and_applied_again_after_a_restart(engine):
    a, _b, c = store(engine, "a", 0, 2), store(engine, "b", 10_000, 1), store(engine, "c", 20_000, 1)
    pin_set = engine.root / "set" / "pins.yaml"
    pin_set.write_text(SET)
    plain = engine.answer("pin", "--tokens-file", c)

    dry = engine.answer("pin", "apply", pin_set, "--dry-run")
    assert dry["dry_run"] and dry["counts"] == {"pin": 2, "refresh": 0, "release": 0, "unchanged": 0}
    assert [pin["pin_id"] for pin in engine.answer("pins")["pins"]] == [plain["pin_id"]]

    applied = engine.answer("pin", "apply", pin_set)
    assert steps(applied) == {"prompts/a.json": ("pin", 2, 2), "prompts/b.json": ("pin", 1, 1)}
    ids = {step["file"]: step["pin_id"] for step in applied["steps"]}
    held = {pin["pin_id"]: pin for pin in engine.answer("pins")["pins"]}
    assert set(held) == {plain["pin_id"], *ids.values()} and "set" not in held[plain["pin_id"]]
    assert {held[pin_id]["set"] for pin_id in ids.values()} == {"hot"}
    assert held[ids["prompts/a.json"]]["pinned"] == {"cpu": 2, "disk": 2}
    assert 590 < held[ids["prompts/a.json"]]["ttl_remaining_s"] <= 600
    assert held[ids["prompts/b.json"]]["expires"] is None

    again = engine.answer("pin", "apply", pin_set, "--dry-run")
    assert steps(again) == {"prompts/a.json": ("refresh", 2, 2), "prompts/b.json": ("unchanged", 1, 1)}

    pin_set.write_text(EDITED)  # b dropped, a's ttl changed
    dry = engine.answer("pin", "apply", pin_set, "--dry-run")
    assert steps(dry) == {"prompts/a.json": ("refresh", 2, 2), ids["prompts/b.json"]: ("release", 1, 1)}
    unchanged = {pin["pin_id"]: pin["expires"] for pin in engine.answer("pins")["pins"]}
    assert unchanged == {pin_id: pin["expires"] for pin_id, pin in held.items()}  # the dry run changed nothing
    done = engine.answer("pin", "apply", pin_set)
    assert done["counts"] == {"pin": 0, "refresh": 1, "release": 1, "unchanged": 0} and "errors" not in done
    after = {pin["pin_id"]: pin for pin in engine.answer("pins")["pins"]}
    assert set(after) == {plain["pin_id"], ids["prompts/a.json"]}  # the plain pin is untouched
    assert 3590 < after[ids["prompts/a.json"]]["ttl_remaining_s"] <= 3600
    replaced = engine.answer("evict", "--tokens-file", a, "--dry-run")  # the refreshed pin holds a's chunks
    assert replaced["removed"] == {"cpu": 0, "disk": 0} and replaced["skipped_pinned"] == {"cpu": 2, "disk": 2}
    engine.answer("unpin", "--pin-id", ids["prompts/a.json"])
    freed = engine.answer("evict", "--tokens-file", a, "--dry-run")  # and the pin it replaced left no hold behind
    assert freed["removed"] == {"cpu": 2, "disk": 2} and freed["held_by_lmcache"] == {"cpu": 0, "disk": 0}

    engine.restart()
    assert engine.answer("pins")["pins"] == []  # pins live in the engine's memory
    store(engine, "a", 0, 2)
    restarted = engine.answer("pin", "apply", pin_set)
    assert steps(restarted) == {"prompts/a.json": ("pin", 2, 2)}
    assert [pin["pin_id"] for pin in engine.answer("pins")["pins"]] == [ids["prompts/a.json"]]  # the same id
    assert engine.answer("lookup", "--tokens-file", a)["hit_tokens"]["total"] == 2 * CHUNK
    kept = engine.answer("evict", "--tokens-file", a, "--dry-run")
    assert kept["removed"] == {"cpu": 0, "disk": 0} and kept["skipped_pinned"] == {"cpu": 2, "disk": 2}


@pytest.mark.slow
def test_the_serve_hook_applies_the_set_to_the_state_files_engine(engine, capsys):
    path = store(engine, "d", 30_000, 1)
    pin_set = engine.root / "hook" / "pins.yaml"
    pin_set.parent.mkdir()
    pin_set.write_text(f"name: boot\npins:\n  - tokens_file: {path}\n")
    state = engine.root / "state.json"  # as kvctl serve writes it once every part is ready
    state.write_text(json.dumps({"name": "boot", "mode": "inprocess", "model": "tiny",
                                 "endpoints": {"internal_api": [engine.url]}}))
    shown = _apply_pins(Output("json"), state, pin_set)
    assert shown["counts"]["pin"] == 1 and "errors" not in shown
    assert "pin set boot: 1 pin" in capsys.readouterr().err
    assert [pin["set"] for pin in engine.answer("pins")["pins"] if pin.get("set") == "boot"] == ["boot"]
    assert pinsets.apply_after_start(state, pin_set).as_dict()["counts"]["unchanged"] == 1  # a second start
    pin_set.write_text("name: boot\npins: [{tokens_file: missing.json}]\n")
    failed = _apply_pins(Output("json"), state, pin_set)  # a warning: serve goes on
    assert "matches no file" in failed["error"] and "warning: pin set" in capsys.readouterr().err
    engine.answer("unpin", "--all")
