"""Configuration files kvctl will not read, or only in bounds: each refusal is one line plus a hint, fast."""

import os
import time

import pytest

from tests.helpers import run_cli, run_kvctl
from tests.unit.test_input_bounds import alias_bomb

COMMANDS = [("config", "validate", "--no-lmcache"), ("config", "show")]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    for name in list(os.environ):
        if name.startswith(("LMCACHE_", "LM_CACHE_")):
            monkeypatch.delenv(name)


def assert_refused(result, first_line: str, code: int = 1) -> None:
    lines = result.stderr.splitlines()
    assert result.code == code, result.stderr
    assert lines[0] == f"error: {first_line}" and lines[1].startswith("hint: ") and len(lines) == 2
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=["validate", "show"])
def test_an_alias_bomb_is_refused_quickly(tmp_path, command):
    path = tmp_path / "lmcache.yaml"
    path.write_text(alias_bomb() + "local_cpu: *l8\n")  # converting it would build 9**9 strings
    started = time.monotonic()
    result = run_kvctl(command[0], command[1], path, *command[2:], timeout=30)  # a regression fails, not hangs
    assert time.monotonic() - started < 15
    assert_refused(result, f"{path} expands to more than 10000 YAML values or 64 levels of nesting")


@pytest.mark.parametrize("command", COMMANDS, ids=["validate", "show"])
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, command):
    fifo = tmp_path / "lmcache.yaml"
    os.mkfifo(fifo)
    for target in (fifo, tmp_path):  # given itself, or found in a configuration directory
        result = run_kvctl(command[0], command[1], target, *command[2:], timeout=30)
        assert_refused(result, f"{fifo} is a FIFO (named pipe), not a regular file")


def test_serve_refuses_a_fifo_in_its_config_directory(tmp_path):
    assert run_cli("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:1").code == 0
    transfer = tmp_path / "cfg" / "kv-transfer-config.json"
    transfer.unlink()
    os.mkfifo(transfer)
    result = run_kvctl("serve", "--config", tmp_path / "cfg", "--dry-run", timeout=30)
    assert_refused(result, f"{transfer} is a FIFO (named pipe), not a regular file")


@pytest.mark.parametrize(("text", "problem"), [("{bad", "is not JSON"), ("[" * 100_000 + "]" * 100_000, "is not JSON"),
                                               ("[1]", "is not a JSON object")], ids=["torn", "nested", "list"])
def test_a_kv_transfer_config_that_is_no_json_object_is_one_line(tmp_path, text, problem):
    assert run_cli("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:1").code == 0
    transfer = tmp_path / "cfg" / "kv-transfer-config.json"
    transfer.write_text(text)
    assert_refused(run_cli("ls", "--config", tmp_path / "cfg"), f"{transfer} {problem}", code=2)
    validated = run_cli("config", "validate", tmp_path / "cfg", "--no-lmcache", "--format", "json")
    assert validated.code == 1 and "Traceback" not in validated.stderr
    assert "kv-transfer-config.json" in validated.json()["findings"][0]["message"]


@pytest.mark.parametrize(("make", "message"), [
    (lambda path: path.mkdir(), "is a directory, not a regular file"),
    (lambda path: path.symlink_to("/dev/zero"), "is a character device, not a regular file"),
    (lambda path: path.write_bytes(b"#" * (1 << 20) + b"\n"), f"is {(1 << 20) + 1} bytes, more than the 1 MiB kvctl "
                                                                "reads from a configuration file"),
], ids=["directory", "device", "oversized"])
@pytest.mark.parametrize("command", COMMANDS, ids=["validate", "show"])
def test_what_is_no_regular_file_of_at_most_1_mib_is_refused(tmp_path, make, message, command):
    make(tmp_path / "lmcache.yaml")
    result = run_cli(*command[:2], tmp_path, *command[2:])
    assert_refused(result, f"{tmp_path / 'lmcache.yaml'} {message}")


def test_a_megabyte_value_is_not_echoed_whole(tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text(f"chunk_size: \"{'9' * 1_000_000}x\"\n")
    validate = run_cli("config", "validate", path, "--no-lmcache", "--format", "table")
    assert validate.code == 1
    (line,) = [line for line in validate.stdout.splitlines() if "chunk_size:" in line]
    assert "…" in line and len(line) < len(str(path)) + 200
    show = run_cli("config", "show", path, "--format", "json")
    (warning,) = show.stderr.splitlines()
    assert warning.startswith("warning: chunk_size from file:lmcache.yaml is ignored: '999") and len(warning) < 200


def test_control_characters_are_escaped(tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text('"\\e[2J\\e[31mchunk_size": 256\nlocal_cpu: "\\e]0;owned\\a"\n')
    result = run_cli("config", "validate", path, "--no-lmcache", "--format", "table")
    assert result.code == 1
    assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout
    assert "unknown key \\x1b[2J\\x1b[31mchunk_size" in result.stdout
    assert "'\\x1b]0;owned\\x07' is not a boolean" in result.stdout
    named = tmp_path / "evil\x1b[31m.yaml"
    os.mkfifo(named)
    refused = run_cli("config", "validate", named, "--no-lmcache")
    assert refused.code == 1 and "\x1b" not in refused.stderr and "evil\\x1b[31m.yaml is a FIFO" in refused.stderr


@pytest.mark.parametrize("tier", ["cpu:nan", "cpu:inf", "cpu:0", "cpu:-1", "disk:/x:inf", "disk:/x:nan", "disk:/x:0"])
@pytest.mark.parametrize("command", [("config", "init", "--out"), ("serve", "--dry-run", "--name")],
                         ids=["init", "serve"])
def test_tier_sizes_that_are_no_positive_number_are_usage_errors(tmp_path, tier, command):
    result = run_cli(*command, tmp_path / "cfg" if command[0] == "config" else "t", "--tier", tier)
    assert_refused(result, f"bad size '{tier.rsplit(':', 1)[1]}' in tier '{tier}'", code=2)
