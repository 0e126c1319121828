"""`kvctl evict`, `ls`, `pin`, `unpin`, `pins` as a user runs them, on one in-memory instance: what the
JSON says, what is removed or pinned, the exit code, and one line plus a hint on stderr when refused."""

import io

import pytest

from kvctl.core.errors import UnreachableError
from tests.fast.conftest import (
    FOREIGN,
    LLAMA_V2,
    OTHER_LLAMA,
    OTHER_PROMPT,
    PROMPT,
    PROMPT_FILE,
    PROMPT_KEYS,
    REMOVAL_FAILS,
    contents,
    without,
)
from tests.fast.memory import CHUNK_BYTES, CoordinatorMemoryInstance


def planned(result: dict) -> set[tuple[str, str]]:
    return {(chunk["tier"], chunk["key"]) for chunk in result["chunks"]}


def refused(result, code: int, message: str, hint: str) -> None:
    """Exit `code`, nothing on stdout, and on stderr only the error line and its hint."""
    assert result.code == code, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: {message}") and lines[1].startswith(f"hint: {hint}"), lines


# -- evict -------------------------------------------------------------------------------------

SELECTIONS = {
    "prompt": ["--tokens-file", PROMPT_FILE],
    "keys": ["--key", PROMPT_KEYS[0], "--key", OTHER_LLAMA[0], "--key", PROMPT_KEYS[0]],
    "tier-all": ["--tier", "cpu", "--all"],
    "every-tier": ["--all"],
    "tier": ["--tier", "disk"],
}


@pytest.mark.parametrize("selection", SELECTIONS.values(), ids=SELECTIONS.keys())
def test_a_dry_run_lists_exactly_what_the_real_run_then_removes(instances, kvctl, selection):
    before = contents(instances.one)
    dry = kvctl("evict", *selection, "--dry-run", "--format", "json")
    assert dry.code == 0, dry.stderr
    shown = dry.json()
    assert shown["dry_run"] is True and sum(shown["removed"].values()) == len(shown["chunks"]) > 0
    assert contents(instances.one) == before

    real = kvctl("evict", *selection, "--yes", "--format", "json")
    assert real.code == 0, real.stderr
    done = real.json()
    assert done["dry_run"] is False
    assert (done["removed"], done["skipped_pinned"]) == (shown["removed"], shown["skipped_pinned"])
    assert planned(done) == planned(shown)
    assert contents(instances.one) == without(before, shown["chunks"])


def test_without_yes_off_a_terminal_nothing_is_removed(instances, kvctl):
    before = contents(instances.one)
    refused(kvctl("evict", "--all"), 2,
            "refusing to evict 8 chunks (cpu: 6, disk: 2) without --yes (not on a terminal)",
            "add --yes, or --dry-run")
    assert contents(instances.one) == before


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("answer", "code", "removed"), [("n\n", 1, False), ("y\n", 0, True)])
def test_on_a_terminal_the_user_is_asked_first(instances, kvctl, monkeypatch, answer, code, removed):
    monkeypatch.setattr("sys.stdin", Terminal(answer))
    before = contents(instances.one)
    result = kvctl("evict", "--tier", "disk")
    assert result.code == code
    assert "evict 2 chunks (disk: 2)?" in result.stderr
    assert (contents(instances.one) != before) == removed


def test_a_whole_tier_takes_only_the_models_chunks(instances, kvctl):
    result = kvctl("evict", "--tier", "cpu", "--all", "--yes", "--format", "json")
    assert result.code == 0, result.stderr
    assert result.json()["removed"] == {"cpu": 6}
    assert contents(instances.one) == {"cpu": set(LLAMA_V2 + FOREIGN),
                                       "disk": set(PROMPT_KEYS[:2] + LLAMA_V2 + FOREIGN)}
    other = kvctl("evict", "--tier", "disk", "--all", "--model", "llama@v2", "--yes", "--format", "json")
    assert other.json()["removed"] == {"disk": 1} and instances.one.stores[1].names == set(PROMPT_KEYS[:2] + FOREIGN)


def test_pinned_chunks_stay_unless_forced(instances, kvctl):
    assert kvctl("pin", "--tokens-file", PROMPT_FILE).code == 0
    kept = kvctl("evict", "--tier", "cpu", "--all", "--yes", "--format", "json").json()
    assert (kept["removed"], kept["skipped_pinned"]) == ({"cpu": 2}, {"cpu": 4})
    assert set(PROMPT_KEYS) <= instances.one.stores[0].names
    assert kvctl("evict", "--key", PROMPT_KEYS[0], "--dry-run").json()["skipped_pinned"] == {"cpu": 1, "disk": 1}
    forced = kvctl("evict", "--tier", "cpu", "--all", "--yes", "--force", "--format", "json").json()
    assert (forced["removed"], forced["skipped_pinned"]) == ({"cpu": 4}, {"cpu": 0})
    assert not set(PROMPT_KEYS) & instances.one.stores[0].names


def test_nothing_to_evict_needs_no_yes(instances, kvctl, tokens_file):
    result = kvctl("evict", "--tokens-file", tokens_file(OTHER_PROMPT))
    assert result.code == 0, result.stderr
    assert result.json() == {"dry_run": False, "removed": {"cpu": 0, "disk": 0},
                             "skipped_pinned": {"cpu": 0, "disk": 0}, "chunks": []}


@pytest.mark.parametrize("selection", [
    [], ["--key", PROMPT_KEYS[0], "--all"], ["--tokens-file", PROMPT_FILE, "--key", PROMPT_KEYS[0]],
    ["--tokens-file", PROMPT_FILE, "--all"], ["--tier", "cpu", "--key", PROMPT_KEYS[0], "--all"],
], ids=["nothing", "key-and-all", "prompt-and-key", "prompt-and-all", "tier-key-and-all"])
def test_evict_says_what_to_select(instances, kvctl, selection):
    before = contents(instances.one)
    refused(kvctl("evict", *selection, "--yes"), 2, "say what to evict: a prompt, --key, or --tier T / --all",
            "add --dry-run to see what would go first")
    assert contents(instances.one) == before


def test_a_removal_that_fails_is_one_line_with_its_exit_code(instances, kvctl):
    instances.one.stores[1].removal_error = REMOVAL_FAILS
    refused(kvctl("evict", "--tier", "disk", "--yes"), 5, REMOVAL_FAILS.message, REMOVAL_FAILS.hint)


def test_a_removal_failing_on_one_tier_still_reports_what_the_others_removed(instances, kvctl):
    instances.one.stores[1].removal_error = REMOVAL_FAILS
    result = kvctl("evict", "--all", "--yes", "--format", "json")
    assert not set(PROMPT_KEYS) & instances.one.stores[0].names  # the cpu tier was evicted ...
    assert result.code == 6, result.stderr  # ... so this is a partial success
    assert result.json()["removed"]["cpu"] == 6
    assert "disk" in result.stderr and REMOVAL_FAILS.message in result.stderr


def test_a_dry_run_table_lists_the_chunks_it_would_remove(instances, kvctl):
    result = kvctl("--format", "table", "evict", "--tier", "disk", "--dry-run")
    assert result.code == 0
    assert PROMPT_KEYS[0] in result.stdout and PROMPT_KEYS[1] in result.stdout


# -- ls ----------------------------------------------------------------------------------------

def test_ls_lists_every_tier_with_totals(instances, kvctl):
    result = kvctl("ls", "--format", "json")
    assert result.code == 0, result.stderr
    listing = result.json()
    assert (listing["errors"], listing["notes"]) == ({}, [])
    cpu, disk = listing["tiers"]
    assert {key: cpu[key] for key in ("tier", "source", "total", "listed", "listed_bytes", "pinned")} == {
        "tier": "cpu", "source": "memory", "total": 7, "listed": 7, "listed_bytes": 7 * CHUNK_BYTES, "pinned": 0}
    assert {chunk["key"] for chunk in cpu["chunks"]} == set(PROMPT_KEYS + OTHER_LLAMA + LLAMA_V2)
    assert cpu["chunks"][0].keys() == {"key", "size", "pinned", "kvctl_pinned", "age_s"}
    assert (disk["tier"], disk["total"]) == ("disk", 3)


@pytest.mark.parametrize(("flags", "shown"), [
    (["--tier", "disk"], {"disk": (3, 3)}),
    (["--tier", "disk", "--tier", "cpu"], {"cpu": (7, 7), "disk": (3, 3)}),
    (["--tier", "all"], {"cpu": (7, 7), "disk": (3, 3)}),
    (["--limit", "2"], {"cpu": (7, 2), "disk": (3, 2)}),
    (["--model", "llama@v2"], {"cpu": (1, 1), "disk": (1, 1)}),
])
def test_ls_tier_limit_and_model(instances, kvctl, flags, shown):
    result = kvctl("ls", *flags, "--format", "json")
    assert result.code == 0, result.stderr
    assert {tier["tier"]: (tier["total"], tier["listed"]) for tier in result.json()["tiers"]} == shown


def test_ls_shows_kvctl_pins(instances, kvctl):
    kvctl("pin", "--tokens-file", PROMPT_FILE)
    cpu = kvctl("ls", "--tier", "cpu").json()["tiers"][0]
    assert cpu["pinned"] == 4
    assert {chunk["key"] for chunk in cpu["chunks"] if chunk["kvctl_pinned"]} == set(PROMPT_KEYS)


def test_ls_names_a_tier_that_fails_and_lists_the_others(instances, kvctl):
    instances.one.failing = {"disk": UnreachableError("cannot reach the disk tier")}
    result = kvctl("ls", "--format", "json")
    assert result.code == 6
    assert [tier["tier"] for tier in result.json()["tiers"]] == ["cpu"]
    assert result.json()["errors"] == {"disk": "cannot reach the disk tier"}
    assert result.stderr.splitlines() == ["error: disk tier: cannot reach the disk tier"]


def test_ls_says_what_it_did_not_look_at(instances, kvctl):
    instances.one.notes = ["the redis tier was not listed: its configuration is unknown"]
    result = kvctl("ls", "--format", "json")
    assert result.code == 0 and result.json()["notes"] == instances.one.notes
    assert result.stderr.splitlines() == ["note: the redis tier was not listed: its configuration is unknown"]


def test_ls_with_every_tier_failing_exits_with_the_failures_code(instances, kvctl):
    instances.one.failing = {tier: UnreachableError(f"cannot reach the {tier} tier") for tier in ("cpu", "disk")}
    result = kvctl("ls")
    assert result.code == 3 and result.json()["tiers"] == []
    assert "error: cpu tier: cannot reach the cpu tier" in result.stderr


def test_ls_refuses_a_limit_below_one(instances, kvctl):
    refused(kvctl("ls", "--limit", "0"), 2, "Invalid value for '--limit'", "see 'kvctl ls --help'")


# -- pin, unpin, pins --------------------------------------------------------------------------

def test_a_pin_in_json(instances, kvctl):
    result = kvctl("pin", "--tokens-file", PROMPT_FILE, "--ttl", "10m", "--format", "json")
    assert result.code == 0, result.stderr
    pin = result.json()
    assert pin.keys() == {"pin_id", "chunks", "tokens", "created", "expires", "ttl_remaining_s", "pinned", "ranks"}
    assert (pin["chunks"], pin["tokens"], pin["pinned"], pin["ranks"]) == (4, 16, {"cpu": 4, "disk": 2}, 1)
    assert pin["ttl_remaining_s"] == 600 and pin["expires"] - pin["created"] == pytest.approx(600)
    assert kvctl("pins").json() == {"pins": [pin]}


def test_a_pin_without_ttl_never_expires_and_keeps_to_its_tiers(instances, kvctl):
    pin = kvctl("pin", "--tokens-file", PROMPT_FILE, "--tier", "disk").json()
    assert (pin["ttl_remaining_s"], pin["expires"], pin["pinned"]) == (None, None, {"disk": 2})


@pytest.mark.parametrize(("ttl", "seconds"), [("600", 600), ("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400),
                                             ("1.5h", 5400), (" 5 m ", 300)])
def test_ttls_are_read_with_their_unit(instances, kvctl, ttl, seconds):
    result = kvctl("pin", "--tokens-file", PROMPT_FILE, "--ttl", ttl)
    assert result.code == 0, result.stderr
    assert result.json()["ttl_remaining_s"] == seconds


@pytest.mark.parametrize("ttl", ["10x", "0", "0s", "-5", "1e3", "m", "10 minutes"])
def test_a_bad_ttl_is_a_usage_error_and_pins_nothing(instances, kvctl, ttl):
    refused(kvctl("pin", "--tokens-file", PROMPT_FILE, "--ttl", ttl), 2, f"bad duration {ttl!r}",
            "write it as 600, 30s, 10m, 2h or 1d")
    assert instances.one.held == {}


def test_unpin_by_id_by_prompt_and_all(instances, kvctl, tokens_file):
    first = kvctl("pin", "--tokens-file", PROMPT_FILE).json()
    second = kvctl("pin", "--tokens-file", tokens_file(PROMPT[:8], "half.json")).json()
    third = kvctl("pin", "--tokens-file", tokens_file(OTHER_PROMPT, "other.json")).json()
    assert [pin["pin_id"] for pin in kvctl("pins").json()["pins"]] == [first["pin_id"], second["pin_id"],
                                                                        third["pin_id"]]

    assert kvctl("unpin", "--pin-id", third["pin_id"]).json() == {"unpinned": [third]}
    by_prompt = kvctl("unpin", "--tokens-file", PROMPT_FILE).json()  # both pins hold its first chunks
    assert [pin["pin_id"] for pin in by_prompt["unpinned"]] == [first["pin_id"], second["pin_id"]]
    assert kvctl("pins").json() == {"pins": []}
    kvctl("pin", "--tokens-file", PROMPT_FILE)
    kvctl("pin", "--tokens-file", tokens_file(OTHER_PROMPT, "other.json"))
    assert len(kvctl("unpin", "--all").json()["unpinned"]) == 2 and instances.one.held == {}


@pytest.mark.parametrize("selection", [
    [], ["--pin-id", "pin1", "--all"], ["--pin-id", "pin1", "--tokens-file", PROMPT_FILE],
    ["--all", "--tokens-file", PROMPT_FILE],
], ids=["nothing", "id-and-all", "id-and-prompt", "all-and-prompt"])
def test_unpin_takes_exactly_one_selection(instances, kvctl, selection):
    kvctl("pin", "--tokens-file", PROMPT_FILE)
    refused(kvctl("unpin", *selection), 2,
            "give exactly one of --pin-id, a prompt (--prompt-file/--chat/--tokens-file), --all",
            "kvctl pins lists the pin ids")
    assert len(instances.one.held) == 1


def test_pin_without_a_prompt_is_a_usage_error(instances, kvctl):
    refused(kvctl("pin"), 2, "give exactly one of --prompt-file, --chat, --tokens-file", "e.g. kvctl lookup")


def test_an_unknown_pin_id_is_the_instances_refusal(instances, kvctl):
    refused(kvctl("unpin", "--pin-id", "nope"), 4, "no pin 'nope'", "kvctl pins lists the pin ids")


@pytest.fixture
def coordinator(instances):
    instances.one = CoordinatorMemoryInstance("mp", instances.one.stores)
    return instances.one


def test_coordinator_pins_are_counted_per_key(coordinator, kvctl):
    pinned = kvctl("pin", "--tokens-file", PROMPT_FILE, "--format", "json")
    assert pinned.code == 0, pinned.stderr
    assert pinned.json() == {"model": "llama", "requested": 4, "affected": 4, "status": "pinned"}
    kvctl("pin", "--tokens-file", PROMPT_FILE)
    assert kvctl("pins").json() == {"pins": [{"key": key, "pin_count": 2} for key in sorted(PROMPT_KEYS)]}
    released = kvctl("unpin", "--tokens-file", PROMPT_FILE).json()
    assert released == {"model": "llama", "requested": 4, "affected": 4, "status": "unpinned"}
    assert {pin["pin_count"] for pin in kvctl("pins").json()["pins"]} == {1}


@pytest.mark.parametrize(("args", "message", "hint"), [
    (["pin", "--tokens-file", PROMPT_FILE, "--ttl", "10m"], "coordinator pins hold a prompt's chunks until "
     "unpinned: no --ttl or --tier", "drop --ttl and --tier"),
    (["unpin", "--pin-id", "pin1"], "the coordinator unpins by prompt only (its pins have no ids)",
     "give the prompt you pinned"),
    (["unpin", "--all"], "the coordinator unpins by prompt only", "give the prompt you pinned"),
])
def test_what_an_instance_cannot_do_is_a_usage_error_with_its_hint(coordinator, kvctl, args, message, hint):
    refused(kvctl(*args), 2, message, hint)
    assert coordinator.counts == {}


# -- tables ------------------------------------------------------------------------------------

TABLES = {  # (run first, the command, what its table shows)
    "ls": ([], ["ls"], ["cpu: 7 chunks; disk: 3 chunks", PROMPT_KEYS[0], "1024"]),
    "ls-limited": ([], ["ls", "--limit", "1", "--tier", "cpu"], ["cpu: 7 chunks (1 listed)"]),
    "ls-pinned": ([["pin", "--tokens-file", PROMPT_FILE]], ["ls"], ["kvctl"]),
    "ls-no-tier": ([], ["ls", "--tier", "redis"], ["no tiers"]),
    "evict-dry-run": ([], ["evict", "--all", "--dry-run"], ["would evict (dry run)", "kept (pinned)"]),
    "evict": ([], ["evict", "--all", "--yes"], ["evicted"]),
    "pin": ([], ["pin", "--tokens-file", PROMPT_FILE, "--ttl", "10m"], ["pin1", "cpu:4 disk:2", "600.0 s"]),
    "pin-nothing-cached": ([], ["pin", "--tokens-file", PROMPT_FILE, "--tier", "redis"],
                           ["nothing cached: nothing pinned", "never"]),
    "pins": ([["pin", "--tokens-file", PROMPT_FILE]], ["pins"], ["pin1", "never"]),
    "pins-none": ([], ["pins"], ["pin id"]),
    "unpin": ([["pin", "--tokens-file", PROMPT_FILE]], ["unpin", "--all"], ["unpinned", "pin1"]),
}
COORDINATOR_TABLES = {
    "coordinator-pin": ([], ["pin", "--tokens-file", PROMPT_FILE], ["llama", "pinned"]),
    "coordinator-pins": ([["pin", "--tokens-file", PROMPT_FILE]], ["pins"], [PROMPT_KEYS[0]]),
    "coordinator-unpin": ([["pin", "--tokens-file", PROMPT_FILE]], ["unpin", "--tokens-file", PROMPT_FILE],
                          ["unpinned"]),
}


@pytest.mark.parametrize(("coordinated", "first", "args", "shown"),
                         [(False, *case) for case in TABLES.values()]
                         + [(True, *case) for case in COORDINATOR_TABLES.values()],
                         ids=[*TABLES, *COORDINATOR_TABLES])
def test_every_result_renders_as_a_table(instances, kvctl, coordinated, first, args, shown):
    if coordinated:
        instances.one = CoordinatorMemoryInstance("mp", instances.one.stores)
    for earlier in first:
        assert kvctl(*earlier).code == 0
    result = kvctl("--format", "table", *args)
    assert result.code == 0, result.stderr
    assert not result.stdout.lstrip().startswith(("{", "["))
    for text in shown:
        assert text in result.stdout, result.stdout
