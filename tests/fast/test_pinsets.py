"""Pin sets (kvctl.core.pins.pinsets): the file and its errors, the ids, the plan against an instance's pins and
its execution, and `kvctl pin apply` in process, on in-memory instances whose pins have ids."""

from __future__ import annotations

import json
import time

import pytest

from kvctl.core.errors import KvctlError, RejectedError
from kvctl.core.instance.protocol import Pin, Unsupported
from kvctl.core.pins import pinsets
from tests.fast.conftest import PROMPT, PROMPT_FILE, sample_stores
from tests.fast.memory import CoordinatorMemoryInstance, MemoryInstance, memory_keys

SECOND = list(range(200, 212))  # 3 chunks, none stored


class PinIdInstance(MemoryInstance):
    """A MemoryInstance whose pins take a given id and refuse a taken one, as the engine's do."""

    pin_ids = True

    def pin(self, tokens, ttl_s, tiers, model=None, pin_id=None, replace=False):
        if pin_id in self.held and not replace:
            raise RejectedError(f"pin {pin_id!r} exists already")
        pin = super().pin(tokens, ttl_s, tiers, model)
        del self.held[pin.pin_id]
        pin.pin_id = pin_id or f"plain{len(self.held) + 1}"
        self.held[pin.pin_id] = (pin, memory_keys(tokens, self.model_name(model)))
        return pin


def write_set(directory, body: str, prompts: dict[str, list[int]] | None = None):
    for name, tokens in (prompts if prompts is not None else {"a.json": PROMPT, "b.json": SECOND}).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(json.dumps(tokens))
    path = directory / "pins.yaml"
    path.write_text(body)
    return path


TWO = "name: hot\npins:\n  - tokens_file: a.json\n    ttl: 10m\n  - tokens_file: b.json\n"


# -- the file ------------------------------------------------------------------------------------


def test_a_set_file_expands_globs_relative_to_itself(tmp_path):
    path = write_set(tmp_path, "name: docs_v2\npins:\n  - tokens_file: ids/*.json\n    ttl: 2h\n    tiers: [cpu]\n"
                     "  - prompt_file: p.txt\n", {"ids/b.json": SECOND, "ids/a.json": PROMPT})
    (tmp_path / "p.txt").write_text("hello")
    loaded = pinsets.load(path)
    assert loaded.name == "docs_v2"
    assert [(e.kind, e.label, e.ttl_s, e.tiers) for e in loaded.entries] == [
        ("tokens_file", "ids/a.json", 7200, ("cpu",)), ("tokens_file", "ids/b.json", 7200, ("cpu",)),
        ("prompt_file", "p.txt", None, None)]
    assert loaded.entries[0].path == tmp_path / "ids" / "a.json"


BAD_FILES = {
    "not-yaml": ("name: [x\n", "not valid YAML"),
    "not-a-mapping": ("- a\n", "is not a mapping"),
    "unknown-key": ("name: x\npins: [{tokens_file: a.json}]\nttl: 5\n", "unknown key 'ttl'"),
    "no-name": ("pins: [{tokens_file: a.json}]\n", "has no `name:`"),
    "bad-name": ("name: my set!\npins: [{tokens_file: a.json}]\n", "set name 'my set!' is not 1-47"),
    "long-name": (f"name: {'n' * 48}\npins: [{{tokens_file: a.json}}]\n", "is not 1-47"),
    "no-entries": ("name: x\npins: []\n", "has no entries under `pins:`"),
    "no-pins-key": ("name: x\n", "has no entries"),
    "entry-not-mapping": ("name: x\npins: [a.json]\n", "pins[1] is not a mapping"),
    "unknown-entry-key": ("name: x\npins: [{tokens_file: a.json, tll: 5}]\n", "pins[1]: unknown key 'tll'"),
    "two-kinds": ("name: x\npins: [{tokens_file: a.json, chat: b.json}]\n", "pins[1] has chat and tokens_file"),
    "no-kind": ("name: x\npins: [{ttl: 5}]\n", "pins[1] has none of"),
    "no-match": ("name: x\npins: [{tokens_file: a.json}, {prompt_file: 'docs/*.txt'}]\n",
                 "pins[2]: prompt_file 'docs/*.txt' matches no file"),
    "bad-ttl": ("name: x\npins: [{tokens_file: a.json, ttl: 10x}]\n", "pins[1]: bad duration '10x'"),
    "zero-ttl": ("name: x\npins: [{tokens_file: a.json, ttl: 0}]\n", "pins[1]: bad duration '0'"),
    "bad-tiers": ("name: x\npins: [{tokens_file: a.json, tiers: [gpu]}]\n", "pins[1]: bad tiers"),
    "overlap": ("name: x\npins: [{tokens_file: '*.json'}, {tokens_file: b.json}]\n",
                "pins[2] and pins[1] both name b.json"),
}


@pytest.mark.parametrize("body, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_set_file_is_one_line_and_a_hint(tmp_path, body, message):
    path = write_set(tmp_path, body)
    with pytest.raises(KvctlError) as raised:
        pinsets.load(path)
    assert raised.value.message.startswith(f"{path}: ") and message in raised.value.message, raised.value.message
    assert "\n" not in raised.value.message and raised.value.hint


def test_a_missing_set_file_is_a_usage_error(tmp_path):
    with pytest.raises(KvctlError) as raised:
        pinsets.load(tmp_path / "nope.yaml")
    assert raised.value.exit_code == 2 and "no pin set file" in raised.value.message


def test_pin_ids_are_deterministic_and_name_their_set(tmp_path):
    loaded = pinsets.load(write_set(tmp_path, TWO))
    first, second = loaded.entries
    pin_id = loaded.pin_id(first, PROMPT)
    assert pin_id == loaded.pin_id(first, list(PROMPT)) and pin_id.startswith("set-hot-") and len(pin_id) == 20
    assert len({pin_id, loaded.pin_id(first, SECOND), loaded.pin_id(second, PROMPT)}) == 3
    assert pinsets.set_of(pin_id) == "hot" and Pin(pin_id, 1, 1, {}).set == "hot"
    assert pinsets.set_of("0123456789ab") is None and Pin("0123456789ab", 1, 1, {}).set is None
    longest = pinsets.PinSet("a-b_" + "c" * 43, tmp_path, []).pin_id(first, PROMPT)
    assert len(longest) == 64 and pinsets.set_of(longest) == "a-b_" + "c" * 43


# -- plan and apply --------------------------------------------------------------------------------


def actions(application) -> dict[str, str]:
    return {step.entry.label if step.entry else step.pin_id: step.action for step in application.steps}


def test_applying_pins_refreshes_and_releases_only_its_own_pins(tmp_path):
    instance = PinIdInstance("memory", sample_stores())
    path = write_set(tmp_path, TWO)
    plain = instance.pin(PROMPT, None, None)  # a plain `kvctl pin`, of the same prompt
    other = instance.pin(SECOND, None, None, pin_id="set-other-0123456789ab")  # another set's

    dry = pinsets.apply(path, instance, dry_run=True)
    assert actions(dry) == {"a.json": "pin", "b.json": "pin"} and dry.dry_run
    assert set(instance.held) == {plain.pin_id, other.pin_id}

    done = pinsets.apply(path, instance)
    assert not done.dry_run and not done.errors
    ids = {step.entry.label: step.pin_id for step in done.steps}
    assert set(instance.held) == {plain.pin_id, other.pin_id, *ids.values()}
    first = {step.entry.label: (step.cached_chunks, step.chunks) for step in done.steps}
    assert first == {"a.json": (4, 4), "b.json": (0, 3)}  # b's chunks are not cached: nothing of it is pinned
    assert [pin.set for pin in instance.pins().pins] == [None, "other", "hot", "hot"]

    created = instance.held[ids["a.json"]][0].created
    time.sleep(0.01)
    released = []
    instance.unpin = lambda **kwargs: released.append(kwargs)
    again = pinsets.apply(path, instance)
    assert actions(again) == {"a.json": "refresh", "b.json": "refresh"}
    assert [step.why for step in again.steps] == ["ttl", "uncached chunks"]
    assert instance.held[ids["a.json"]][0].created > created  # pinned again: a fresh TTL
    assert released == []  # a refresh replaces the pin in one step: its chunks are never unpinned in between
    del instance.unpin

    path.write_text("name: hot\npins:\n  - tokens_file: b.json\n")  # drop a.json
    instance.stores[0].names.update(memory_keys(SECOND, "llama"))  # b.json is cached now
    dry = pinsets.apply(path, instance, dry_run=True)
    assert actions(dry) == {"b.json": "refresh", ids["a.json"]: "release"}
    assert ids["a.json"] in instance.held
    pinsets.apply(path, instance)
    assert set(instance.held) == {plain.pin_id, other.pin_id, ids["b.json"]}
    assert actions(pinsets.apply(path, instance, dry_run=True)) == {"b.json": "unchanged"}


def test_a_changed_prompt_is_a_new_pin_and_the_old_one_goes(tmp_path):
    instance = PinIdInstance("memory", sample_stores())
    path = write_set(tmp_path, "name: hot\npins: [{tokens_file: a.json}]\n")
    old = pinsets.apply(path, instance).steps[0].pin_id
    (tmp_path / "a.json").write_text(json.dumps(SECOND))
    plan = pinsets.apply(path, instance, dry_run=True)
    assert [(step.action, step.pin_id == old) for step in plan.steps] == [("pin", False), ("release", True)]


def test_a_failing_step_is_named_and_the_others_go_on(tmp_path):
    instance = PinIdInstance("memory", sample_stores())
    path = write_set(tmp_path, TWO)
    plan = pinsets.apply(path, instance, dry_run=True)
    instance.pin(PROMPT, None, None, pin_id=plan.steps[0].pin_id)  # taken between the plan and its execution
    done = pinsets.execute(plan, instance)
    assert list(done.errors) == ["a.json"] and "exists already" in done.errors["a.json"]
    assert done.as_dict()["errors"] == done.errors and plan.steps[1].pin_id in instance.held


def test_a_pin_gone_since_the_plan_is_pinned_again_or_counted_released(tmp_path):
    instance = PinIdInstance("memory", sample_stores())
    path = write_set(tmp_path, TWO)
    ids = [step.pin_id for step in pinsets.apply(path, instance).steps]
    path.write_text("name: hot\npins:\n  - tokens_file: a.json\n    ttl: 10m\n")
    plan = pinsets.apply(path, instance, dry_run=True)
    instance.unpin(everything=True)  # both pins end (a TTL, a restart) between the plan and its execution
    done = pinsets.execute(plan, instance)
    assert not done.errors and set(instance.held) == {ids[0]}


NO_TTL = "name: hot\npins:\n  - tokens_file: a.json\n  - tokens_file: b.json\n"


def test_a_coordinators_set_is_kept_in_a_ledger_and_releases_only_its_own_pins(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    coordinator = CoordinatorMemoryInstance("mp", sample_stores())
    coordinator.pin(PROMPT, None, None)  # someone else's pin of the same prompt
    path = write_set(tmp_path, NO_TTL)
    done = pinsets.apply(path, coordinator)
    assert actions(done) == {"a.json": "pin", "b.json": "pin"} and not done.errors
    assert [(step.chunks, step.cached_chunks) for step in done.steps] == [(4, 4), (3, 0)]
    assert coordinator.counts == {key: 2 for key in memory_keys(PROMPT, "llama")}  # one pin each: theirs and ours

    again = pinsets.apply(path, coordinator)
    assert actions(again) == {"a.json": "unchanged", "b.json": "pin"}  # b has nothing cached to hold yet
    assert coordinator.counts == {key: 2 for key in memory_keys(PROMPT, "llama")}

    coordinator.counts.clear()  # a coordinator restarted without --metadata-path: its pins are gone
    lost = pinsets.apply(path, coordinator, dry_run=True)
    assert actions(lost) == {"a.json": "pin", "b.json": "pin"} and lost.steps[0].why.startswith("lost")
    pinsets.apply(path, coordinator)
    coordinator.pin(PROMPT, None, None)

    path.write_text("name: hot\npins:\n  - tokens_file: b.json\n")  # a.json dropped
    released = pinsets.apply(path, coordinator)
    assert [step.action for step in released.steps] == ["pin", "release"] and not released.errors
    assert coordinator.counts == {key: 1 for key in memory_keys(PROMPT, "llama")}  # the other pin stays
    assert actions(pinsets.apply(path, coordinator, dry_run=True)) == {"b.json": "pin"}  # released for good


class RacedCoordinator(CoordinatorMemoryInstance):
    """A coordinator another kvctl applies the same set to right after this one has read its pins."""

    def __init__(self, *args, other_apply=None) -> None:
        super().__init__(*args)
        self.other_apply = other_apply

    def pins(self, model=None):
        seen = super().pins(model)
        if self.other_apply:
            self.other_apply, run = None, self.other_apply
            run()
        return seen


def test_a_pin_another_apply_makes_during_the_plan_is_not_taken_for_lost(tmp_path, monkeypatch):
    """Bug: the plan read the coordinator's pins, then the ledger; a pin another kvctl made and recorded in
    between looked recorded but not held ("lost"), and was pinned a second time (one release left it pinned)."""
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_set(tmp_path, "name: hot\npins:\n  - tokens_file: a.json\n")
    coordinator = RacedCoordinator("mp", sample_stores(), other_apply=lambda: pinsets.apply(path, coordinator))
    done = pinsets.apply(path, coordinator)
    assert not done.errors and not done.of("pin")
    assert coordinator.counts == {key: 1 for key in memory_keys(PROMPT, "llama")}


def test_a_coordinators_set_takes_no_ttl_or_tiers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(Unsupported) as raised:
        pinsets.apply(write_set(tmp_path, TWO), CoordinatorMemoryInstance("mp", sample_stores()))
    assert "a.json has a ttl or tiers" in raised.value.message and "drop ttl:" in raised.value.hint


# -- the command ---------------------------------------------------------------------------------


@pytest.fixture
def pinning(instances):
    instances.one = PinIdInstance("memory", sample_stores())
    instances.members = {name: PinIdInstance(name, sample_stores()) for name in "ab"}
    instances.inventory.write_text("instances:\n  a: {internal_api: http://127.0.0.1:1}\n"
                                   "  b: {internal_api: http://127.0.0.1:2}\n")
    return instances


def test_pin_set_apply_in_json_and_pins_shows_the_set(pinning, kvctl, tmp_path):
    path = write_set(tmp_path, TWO)
    dry = kvctl("pin", "apply", path, "--dry-run", "--format", "json")
    assert dry.code == 0, dry.stderr
    shown = dry.json()
    assert shown["dry_run"] is True and shown["set"] == "hot" and shown["counts"] == {
        "pin": 2, "refresh": 0, "release": 0, "unchanged": 0}
    assert not pinning.one.held
    done = kvctl("pin", "apply", path, "--format", "json").json()
    assert [(s["action"], s["file"], s["cached_chunks"], s["chunks"]) for s in done["steps"]] == [
        ("pin", "a.json", 4, 4), ("pin", "b.json", 0, 3)]
    listed = kvctl("pins", "--format", "json").json()["pins"]
    assert [(p["pin_id"], p["set"]) for p in listed] == [(s["pin_id"], "hot") for s in done["steps"]]
    table = kvctl("pin", "apply", path, "--format", "table")
    assert table.code == 0 and "refresh" in table.stdout and "0/3" in table.stdout


def test_pin_set_apply_on_every_instance(pinning, kvctl, tmp_path):
    done = kvctl("pin", "apply", write_set(tmp_path, TWO), *pinning.all, "--format", "json")
    assert done.code == 0, done.stderr
    assert [(report["instance"], report["counts"]["pin"]) for report in done.json()["instances"]] == [
        ("a", 2), ("b", 2)]
    assert all(len(member.held) == 2 for member in pinning.members.values())


def test_pin_set_apply_refuses_a_bad_file_before_asking_anyone(pinning, kvctl, tmp_path):
    result = kvctl("pin", "apply", write_set(tmp_path, "name: x\npins: []\n"))
    assert result.code == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and "has no entries" in lines[0] and lines[1].startswith("hint: ")


def test_pin_is_a_command_and_the_group_of_apply(pinning, kvctl):
    shown = kvctl("pin", "--help")
    assert shown.code == 0 and "--prompt-file" in shown.stdout and "--ttl" in shown.stdout
    assert "apply" in shown.stdout and "Apply a pin set" in shown.stdout
    plain = kvctl("pin", "--tokens-file", PROMPT_FILE, "--ttl", "10m", "--format", "json")
    assert plain.code == 0, plain.stderr
    assert plain.json()["pin_id"] in pinning.one.held and len(pinning.one.held) == 1


def test_pin_options_before_apply_are_a_usage_error(pinning, kvctl, tmp_path):
    result = kvctl("pin", "--instance", "all", "apply", write_set(tmp_path, TWO))
    assert result.code == 2 and "--instance" in result.stderr and "after 'apply'" in result.stderr
    assert not pinning.one.held and not any(member.held for member in pinning.members.values())


def test_an_inventory_names_the_pin_set_serve_applies(tmp_path):
    from kvctl.core.instance.addresses import pin_set_file

    inventory = tmp_path / "kvctl.yaml"
    inventory.write_text("instances:\n  a: {state: s.json, pins: sets/a.yaml}\n  b: {state: s.json}\n"
                         "  c: {state: s.json, pins: [x]}\n")
    assert pin_set_file("a", inventory) == tmp_path / "sets" / "a.yaml"
    assert pin_set_file("b", inventory) is None and pin_set_file("nobody", inventory) is None
    with pytest.raises(KvctlError, match="pins is not a file name"):
        pin_set_file("c", inventory)


def test_a_pin_set_for_a_configuration_directory_is_refused_in_one_line(tmp_path):
    """A configuration directory holds no pins (they live in an engine): refused before any ledger is kept."""
    from tests.helpers import run_cli

    assert run_cli("config", "init", "--out", tmp_path / "cfg").code == 0
    path = write_set(tmp_path, "name: system\npins:\n  - tokens_file: a.json\n")
    result = run_cli("pin", "apply", path, "--config", tmp_path / "cfg")
    assert result.code == 2 and "pins live in a running engine" in result.stderr, result.stderr
    assert "unexpected" not in result.stderr and "hint:" in result.stderr
