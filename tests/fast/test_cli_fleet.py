"""Cache commands with --instance all: every member of the inventory (a, b, c) answers at once, one that fails
or hangs is named on stderr with its hint while the others' reports stand, and one exit code sums up."""

import time

import pytest

from kvctl.core.errors import RejectedError, ServerError, UnreachableError
from tests.fast.conftest import PROMPT_FILE, PROMPT_KEYS, REMOVAL_FAILS, contents, without
from tests.fast.memory import FailingInstance, HangingInstance

REFUSED = RejectedError("the route refused the request", hint="check the instance's token")


def by_member(result) -> dict[str, dict]:
    return {report.pop("instance"): report for report in result.json()["instances"]}


def test_a_dry_run_plans_on_every_member_and_the_real_run_removes_just_that(instances, kvctl):
    before = instances.fleet_contents()
    dry = kvctl("evict", "--all", *instances.all, "--dry-run", "--format", "json")
    assert dry.code == 0, dry.stderr
    assert dry.json()["dry_run"] is True
    plans = by_member(dry)
    assert list(plans) == ["a", "b", "c"]
    assert all(plan["dry_run"] and plan["removed"] == {"cpu": 6, "disk": 2} for plan in plans.values())
    assert instances.fleet_contents() == before

    real = kvctl("evict", "--all", *instances.all, "--yes", "--format", "json")
    assert real.code == 0, real.stderr
    for name, done in by_member(real).items():
        assert not done["dry_run"] and done["removed"] == plans[name]["removed"]
        assert done["chunks"] == plans[name]["chunks"]
        assert contents(instances.members[name]) == without(before[name], plans[name]["chunks"])


def test_one_question_for_the_whole_fleet_and_off_a_terminal_no_member_evicts(instances, kvctl):
    before = instances.fleet_contents()
    result = kvctl("evict", "--all", *instances.all)
    assert result.code == 2 and result.stdout == ""
    assert "refusing to evict 24 chunks (cpu: 18, disk: 6) without --yes" in result.stderr
    assert instances.fleet_contents() == before


@pytest.mark.parametrize("error", [REFUSED, ServerError("LMCache answered 500", hint="see its log"),
                                   UnreachableError("cannot reach b", hint="start it")], ids=["4", "5", "3"])
def test_a_failing_member_is_named_and_the_others_evict(instances, kvctl, error):
    instances.members["b"] = FailingInstance("b", error)
    result = kvctl("evict", "--tokens-file", PROMPT_FILE, *instances.all, "--yes", "--format", "json")
    assert result.code == 6
    reports = by_member(result)
    assert reports["b"] == {"errors": {"instance": error.message}, "hint": error.hint}
    assert reports["a"]["removed"] == reports["c"]["removed"] == {"cpu": 4, "disk": 2}
    assert result.stderr.splitlines() == [f"error: b: {error.message}", f"hint: {error.hint}"]
    for name in "ac":
        assert not set(PROMPT_KEYS) & instances.members[name].stores[0].names


def test_a_member_whose_removal_fails_is_named_after_its_plan(instances, kvctl):
    instances.members["c"].stores[1].removal_error = REMOVAL_FAILS
    result = kvctl("evict", "--tier", "disk", *instances.all, "--yes")
    assert result.code == 6
    reports = by_member(result)
    assert reports["a"]["removed"] == reports["b"]["removed"] == {"disk": 2}
    assert reports["c"] == {"errors": {"instance": REMOVAL_FAILS.message}, "hint": REMOVAL_FAILS.hint}
    assert f"error: c: {REMOVAL_FAILS.message}" in result.stderr


def test_a_hanging_member_is_left_behind_after_the_timeout(instances, kvctl, release):
    instances.members["c"] = HangingInstance("c", release)
    started = time.monotonic()
    result = kvctl("evict", "--all", *instances.all, "--timeout", "0.3", "--dry-run")
    assert time.monotonic() - started < 2
    assert result.code == 6
    reports = by_member(result)
    assert reports["c"] == {"errors": {"instance": "no answer in 0.3 s"},
                            "hint": "raise --timeout, or check the instance"}
    assert reports["a"]["removed"] == {"cpu": 6, "disk": 2}
    assert "error: c: no answer in 0.3 s" in result.stderr


@pytest.mark.parametrize(("failures", "code"), [
    ({"a": "hang", "b": "hang", "c": "hang"}, 3),  # all failed alike: their own code
    ({"a": REFUSED, "b": REFUSED, "c": REFUSED}, 4),
    ({"a": "hang", "b": REFUSED, "c": REFUSED}, 6),  # failed differently
    ({"a": UnreachableError("down"), "b": "hang"}, 6),  # one answered
], ids=["all-hang", "all-refuse", "hang-and-refuse", "one-answers"])
def test_the_fleets_exit_code(instances, kvctl, release, failures, code):
    for name, failure in failures.items():
        instances.members[name] = (HangingInstance(name, release) if failure == "hang"
                                   else FailingInstance(name, failure))
    result = kvctl("evict", "--all", *instances.all, "--timeout", "0.3", "--dry-run")
    assert result.code == code
    assert {line.split(":")[1].strip() for line in result.stderr.splitlines() if line.startswith("error:")} == set(
        failures)


def test_ls_lists_every_member(instances, kvctl):
    result = kvctl("ls", "--tier", "disk", *instances.all, "--format", "json")
    assert result.code == 0, result.stderr
    reports = by_member(result)
    assert list(reports) == ["a", "b", "c"]
    assert all([tier["total"] for tier in report["tiers"]] == [3] for report in reports.values())


def test_ls_names_a_members_failing_tier(instances, kvctl):
    instances.members["b"].failing = {"disk": UnreachableError("cannot reach the disk tier")}
    result = kvctl("ls", *instances.all)
    assert result.code == 6
    reports = by_member(result)
    assert reports["b"]["errors"] == {"disk": "cannot reach the disk tier"}
    assert [tier["tier"] for tier in reports["b"]["tiers"]] == ["cpu"]
    assert result.stderr.splitlines() == ["error: b: disk: cannot reach the disk tier"]


COMMANDS = {  # a fleet command, and a key of each member's report
    "ls": (["ls"], "tiers"),
    "pins": (["pins"], "pins"),
    "pin": (["pin", "--tokens-file", PROMPT_FILE], "pin_id"),
    "unpin": (["unpin", "--all"], "unpinned"),
    "evict": (["evict", "--tier", "disk", "--dry-run"], "removed"),
}


@pytest.mark.parametrize(("args", "field"), COMMANDS.values(), ids=COMMANDS.keys())
def test_every_fleet_command_reports_each_member_and_names_the_failing_one(instances, kvctl, args, field):
    instances.members["a"] = FailingInstance("a", REFUSED)
    result = kvctl(*args, *instances.all, "--format", "json")
    assert result.code == 6
    reports = by_member(result)
    assert reports["a"] == {"errors": {"instance": REFUSED.message}, "hint": REFUSED.hint}
    assert field in reports["b"] and field in reports["c"]
    assert result.stderr.splitlines() == [f"error: a: {REFUSED.message}", f"hint: {REFUSED.hint}"]


@pytest.mark.parametrize(("args", "shown"), [
    (["ls"], ["cpu: 7 chunks; disk: 3 chunks"]),
    (["evict", "--all", "--dry-run"], ["b: would evict (dry run)", "c: would evict (dry run)"]),
    (["evict", "--all", "--yes"], ["b: evicted"]),
    (["pin", "--tokens-file", PROMPT_FILE], ["pin1"]),
    (["pins"], ["pin id"]),
    (["unpin", "--all"], ["b: unpinned"]),
], ids=["ls", "evict-dry-run", "evict", "pin", "pins", "unpin"])
def test_fleet_tables_render_with_a_failing_member(instances, kvctl, args, shown):
    instances.members["a"] = FailingInstance("a", REFUSED)
    result = kvctl("--format", "table", *args, *instances.all)
    assert result.code == 6
    assert {line.split(":")[0] for line in result.stdout.splitlines()} >= {"b", "c"}  # each table's title
    for text in shown:
        assert text in result.stdout, result.stdout
    assert f"error: a: {REFUSED.message}" in result.stderr
