"""What kvctl reads and echoes is bounded: YAML budgets, regular files under a size cap, messages that
never repeat megabytes or raw control characters, sizes that are real numbers."""

import os
import time

import pytest

from kvctl.core.cache.prewarm import load_prompts
from kvctl.core.common.display import redact_url, shown
from kvctl.core.common.safe_files import MAX_FILE_BYTES, MAX_YAML_NODES, load_yaml, load_yaml_file, read_text
from kvctl.core.errors import ExitCode, KvctlError, UsageError
from kvctl.core.lmcache.config import ConversionError, convert_value
from kvctl.core.lmcache.tiers import parse_tier
from kvctl.core.lmcache.tokens import read_chat, read_token_ids


def alias_bomb(levels: int = 9) -> str:
    """The "billion laughs": each level lists the previous one 9 times (9**9 strings from a few hundred bytes)."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{n}: &l{n} [{','.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once_naming_the_file():
    started = time.monotonic()
    with pytest.raises(KvctlError) as caught:
        load_yaml(alias_bomb(), "bomb.yaml")
    assert time.monotonic() - started < 1
    assert caught.value.message == (f"bomb.yaml expands to more than {MAX_YAML_NODES} YAML values or 64 levels of "
                                    "nesting")
    assert "alias bomb" in caught.value.hint and caught.value.exit_code == ExitCode.ERROR


@pytest.mark.parametrize(("text", "message"), [
    ("a: &a [*a]\n", "has a recursive YAML alias"),  # safe_load builds a list that contains itself
    ("[" * 100 + "]" * 100, "levels of nesting"),  # composing it recurses; later code would too
    ("l0: &l0 [1]\n" + "".join(f"l{n}: &l{n} [*l{n - 1}]\n" for n in range(1, 80)), "levels of nesting"),  # by aliases
    ("[" + "1, " * (MAX_YAML_NODES + 1) + "]", "more than"),  # no alias, but past the budget
])
def test_yaml_beyond_the_budgets_is_refused(text, message):
    with pytest.raises(KvctlError, match=message):
        load_yaml(text, "x.yaml")


def test_ordinary_yaml_loads_as_safe_load_does():
    text = "base: &base {chunk_size: 256}\nother:\n  <<: *base\n  local_cpu: true\nlist: [*base, *base]\n"
    assert load_yaml(text, "x.yaml") == {"base": {"chunk_size": 256}, "other": {"chunk_size": 256, "local_cpu": True},
                                         "list": [{"chunk_size": 256}, {"chunk_size": 256}]}
    assert load_yaml("", "x.yaml") is None


def test_a_value_python_cannot_build_is_a_yaml_error_not_a_crash():
    import yaml

    with pytest.raises(yaml.YAMLError, match="4300 digits"):
        load_yaml("n: " + "1" * 5000, "x.yaml")


def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "lmcache.yaml"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(KvctlError) as caught:
        read_text(fifo)
    assert time.monotonic() - started < 1
    assert caught.value.message == f"{fifo} is a FIFO (named pipe), not a regular file"


@pytest.mark.parametrize(("path", "kind"), [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_devices_are_refused(path, kind):
    with pytest.raises(KvctlError, match=f"{path} is {kind}, not a regular file"):
        read_text(path)


def test_directory_and_oversized_files_are_refused(tmp_path):
    with pytest.raises(KvctlError, match="is a directory, not a regular file"):
        read_text(tmp_path)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(KvctlError, match=f"is {MAX_FILE_BYTES + 1} bytes, more than the 1 MiB"):
        load_yaml_file(big)
    big.write_bytes(b"a: 1\n" + b"#" * (MAX_FILE_BYTES - 5))
    assert load_yaml_file(big) == {"a": 1}  # exactly at the cap is fine


@pytest.mark.parametrize(("name", "read"), [("tokens.json", read_token_ids), ("chat.json", read_chat),
                                           ("prompts.jsonl", lambda path: load_prompts([path], chat=False))])
def test_prompt_files_nested_past_pythons_stack_are_one_line(tmp_path, name, read):
    path = tmp_path / name
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(KvctlError, match="is not valid JSON") as caught:
        read(str(path))
    assert caught.value.hint


def test_shown_truncates_escapes_and_redacts():
    assert shown("x" * 1_000_000) == "x" * 79 + "…"
    assert shown("a\x1b[31mb\nc\x07") == "a\\x1b[31mb\\nc\\x07"
    assert shown("\n" * 100) == "\\n" * 39 + "…"  # cut between escapes, never inside one
    assert shown("redis://u:hunter2@h:1") == "redis://u:***@h:1"
    assert shown("yes", quoted=True) == "'yes'" and shown(1.5) == "1.5"
    assert shown("/a/long/path" * 100, 4096) == "/a/long/path" * 100


@pytest.mark.parametrize(("text", "redacted"), [
    ("redis://bob:hunter2@h:1/2", "redis://bob:***@h:1/2"),
    ("rediss://:hunter2@h:6380", "rediss://:***@h:6380"),
    ("redis-sentinel://u:hunter2@s1:26379,s2/master", "redis-sentinel://u:***@s1:26379,s2/master"),
    ("redis-cluster://:hunter2@a:1,b:2", "redis-cluster://:***@a:1,b:2"),
    ("unix://:hunter2@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
    ("unix:///run/redis.sock?password=hunter2&db=1", "unix:///run/redis.sock?password=***&db=1"),
    ("redis://h:6379/0?password=hunter2", "redis://h:6379/0?password=***"),
    ("http://user:hunter2@proxy:3128/x", "http://user:***@proxy:3128/x"),
    ("s3://AKIA:hunter2@bucket/key", "s3://AKIA:***@bucket/key"),
    ("redis://:hunt@er2@h:1", "redis://:***@h:1"),  # an unescaped @ in the password
    ("mock://h/?api_key=hunter2", "mock://h/?api_key=***"),
    ("remote_url is redis://u:hunter2@h:1, not 2", "remote_url is redis://u:***@h:1, not 2"),
    ('{"url": "redis://u:hunter2@h:1"}', '{"url": "redis://u:***@h:1"}'),
    ("redis://user@h:1", "redis://user@h:1"),  # no password, nothing to hide
    ("not a url", "not a url"),
])
def test_every_url_scheme_is_redacted(text, redacted):
    assert redact_url(text) == redacted


@pytest.mark.parametrize("text", ["?" + "a" * 1_000_000 + "=", "?a" * 500_000 + "=", "://" + "a@" * 500_000])
def test_redaction_takes_linear_time(text):
    started = time.monotonic()
    redact_url(text)
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("text", ["cpu:nan", "cpu:inf", "cpu:-inf", "cpu:0", "cpu:-1", "disk:/x:inf", "disk:/x:nan",
                                  "disk:/x:0", "disk:/x:-2"])
def test_tier_sizes_must_be_finite_and_positive(text):
    with pytest.raises(UsageError) as caught:
        parse_tier(text)
    assert caught.value.exit_code == ExitCode.USAGE
    assert caught.value.message.startswith("bad size") and caught.value.hint


@pytest.mark.parametrize(("key", "raw"), [
    ("max_local_cpu_size", float("nan")), ("max_local_cpu_size", "nan"), ("max_local_cpu_size", float("inf")),
    ("max_local_disk_size", -1), ("chunk_size", float("nan")), ("pd_shutdown_timeout_sec", float("nan")),
    ("chunk_size", "9" * 400), ("max_local_cpu_size", "9" * 400), ("extra_config", "[" * 100_000 + "]" * 100_000),
])
def test_nan_and_impossible_sizes_do_not_convert(key, raw):
    with pytest.raises(ConversionError):
        convert_value(key, raw)


def test_infinity_stays_valid_where_it_means_something():
    assert convert_value("pd_allocation_timeout_sec", float("inf")) == float("inf")  # LMCache's own default
    assert convert_value("max_local_disk_size", 0) == 0.0  # no disk tier


def test_conversion_errors_echo_a_bounded_escaped_value():
    with pytest.raises(ConversionError) as caught:
        convert_value("chunk_size", "\x1b[2J" + "9" * 1_000_000 + "x")
    assert len(str(caught.value)) < 120 and "\x1b" not in str(caught.value) and "\\x1b[2J" in str(caught.value)
