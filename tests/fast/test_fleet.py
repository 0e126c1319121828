"""`--instance all`: one operation on every fleet member at once; each fails on its own, the exit code sums up."""

import threading
import time

import pytest

from kvctl.core.errors import ExitCode, RejectedError, ServerError
from kvctl.core.instance.address import Address
from kvctl.core.instance.addresses import fan_out, fleet_exit_code, fleet_reports


def behaviours(release: threading.Event):
    """What each fleet member does when asked, by name."""
    def answer(address):
        return {"name": address.name, "hit_tokens": 64}

    def rejected(_address):
        raise RejectedError("the route refused the request", hint="check the token")

    def server_error(_address):
        raise ServerError("LMCache answered 500")

    def surprise(_address):
        raise ValueError("boom")

    def hang(_address):
        release.wait(30)
        return {"late": True}

    def partial(_address):
        return {"hit_tokens": 32, "errors": {"redis": "cannot reach Redis"}}

    return {"ok": answer, "ok2": answer, "rejected": rejected, "server_error": server_error, "surprise": surprise,
            "hang": hang, "partial": partial}


def run(names, release, timeout=5.0, **problems):
    table = behaviours(release)
    members = [Address(name, problem=problems.get(name)) for name in names]
    return fan_out(members, lambda address: table[address.name.split("#")[0]](address), timeout)


def by_name(outcomes):
    return {outcome.instance: outcome for outcome in outcomes}


def test_every_member_answers_in_order(release):
    outcomes = run(["ok", "ok2"], release)
    assert [(o.instance, o.result, o.error, o.exit_code) for o in outcomes] == [
        ("ok", {"name": "ok", "hit_tokens": 64}, None, ExitCode.OK),
        ("ok2", {"name": "ok2", "hit_tokens": 64}, None, ExitCode.OK)]
    assert fleet_exit_code(outcomes) == ExitCode.OK


def test_a_failing_member_keeps_its_own_message_hint_and_code(release):
    outcomes = by_name(run(["ok", "rejected", "server_error"], release))
    assert outcomes["ok"].error is None
    assert (outcomes["rejected"].error, outcomes["rejected"].hint, outcomes["rejected"].exit_code) == (
        "the route refused the request", "check the token", ExitCode.REJECTED)
    assert outcomes["server_error"].exit_code == ExitCode.SERVER_ERROR


def test_an_unexpected_exception_is_one_members_error(release):
    outcome = by_name(run(["surprise", "ok"], release))["surprise"]
    assert outcome.error == "unexpected ValueError: boom" and outcome.exit_code == ExitCode.ERROR
    assert "--debug" in outcome.hint


def test_a_member_that_could_not_be_found_is_reported_without_being_asked(release):
    asked = []
    members = [Address("gone", problem="no kvctl serve state at /tmp/gone.json"), Address("ok")]
    outcomes = by_name(fan_out(members, lambda address: asked.append(address.name) or {}, 5))
    assert asked == ["ok"]
    assert (outcomes["gone"].error, outcomes["gone"].exit_code) == ("no kvctl serve state at /tmp/gone.json",
                                                                    ExitCode.UNREACHABLE)
    assert "start it" in outcomes["gone"].hint


def test_a_hanging_member_is_left_behind_after_the_timeout(release):
    started = time.monotonic()
    outcomes = by_name(run(["hang", "ok"], release, timeout=0.2))
    assert time.monotonic() - started < 1.0
    assert outcomes["ok"].result == {"name": "ok", "hit_tokens": 64}
    assert (outcomes["hang"].error, outcomes["hang"].exit_code) == ("no answer in 0.2 s", ExitCode.UNREACHABLE)
    assert "--timeout" in outcomes["hang"].hint


def test_members_are_asked_at_once_not_one_after_another(release):
    def slow(_address):
        time.sleep(0.3)
        return {}

    started = time.monotonic()
    outcomes = fan_out([Address(f"m{i}") for i in range(6)], slow, 5)
    assert time.monotonic() - started < 1.2  # one after another would take 1.8 s
    assert all(outcome.error is None for outcome in outcomes)


@pytest.mark.parametrize(("names", "code"), [
    (["ok", "ok2"], ExitCode.OK),
    (["rejected"], ExitCode.REJECTED),  # the only target's own code
    (["rejected", "rejected#2"], ExitCode.REJECTED),  # every target failed alike
    (["rejected", "server_error"], ExitCode.PARTIAL),  # failed differently
    (["ok", "rejected"], ExitCode.PARTIAL),
    (["ok", "surprise"], ExitCode.PARTIAL),
    (["ok", "partial"], ExitCode.PARTIAL),  # everyone answered, one only in part
    (["partial"], ExitCode.PARTIAL),
])
def test_the_fleets_exit_code(release, names, code):
    reports, exit_code = fleet_reports(run(names, release), lambda result: result)
    assert exit_code == code
    assert [report["instance"] for report in reports] == names


def test_reports_carry_each_members_payload_or_failure(release):
    reports, code = fleet_reports(run(["ok", "rejected", "partial"], release), lambda result: {"payload": result})
    assert reports == [
        {"instance": "ok", "payload": {"name": "ok", "hit_tokens": 64}},
        {"instance": "rejected", "errors": {"instance": "the route refused the request"}, "hint": "check the token"},
        {"instance": "partial", "payload": {"hit_tokens": 32, "errors": {"redis": "cannot reach Redis"}}}]
    assert code == ExitCode.PARTIAL

