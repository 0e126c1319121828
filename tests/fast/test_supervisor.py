"""What `kvctl serve` reads while it waits: a child's fatal log line, and the API key vLLM's routes want."""

import pytest

from kvctl.core.serve.launch import Component
from kvctl.core.serve.supervisor import LogWatch, _vllm_headers


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "child.log"
    path.write_text("Traceback (most recent call last):\nERROR left by an older run\n")
    return path


def append(path, text):
    with open(path, "a") as handle:
        handle.write(text)


def test_only_this_runs_lines_count(log):
    watch = LogWatch(str(log))
    append(log, "INFO starting\nINFO loading weights\n")
    watch.scan()
    assert watch.fatal is None


def test_a_fatal_line_written_in_pieces_is_seen_once_whole(log):
    watch = LogWatch(str(log))
    append(log, "INFO starting\n\x1b[31;20m[2025-01-01 10:00:00,000] LMCache ERROR:\x1b[0m cannot reach redis")
    watch.scan()
    assert watch.fatal is None  # the line is not complete yet
    append(log, "://u:hunter2@h:1 \x1b[3m(connector.py:42:lmcache)\x1b[0m\nERROR a later one\n")
    watch.scan()
    assert watch.fatal == ("[2025-01-01 10:00:00,000] LMCache ERROR: cannot reach redis://u:***@h:1 "
                           "(connector.py:42:lmcache)")  # as LMCache logs it, less its colours and the password
    append(log, "Traceback (most recent call last):\n")
    watch.scan()
    assert "cannot reach" in watch.fatal  # the first one is kept
    assert watch.tail().splitlines()[0] == "INFO starting"


@pytest.mark.parametrize("line", ["OSError: [Errno 98] Address already in use", "Traceback (most recent call last):",
                                  "(EngineCore pid=7) ERROR 12-03 10:12:16 [core.py:1510] EngineCore failed"])
def test_fatal_lines(log, line):
    watch = LogWatch(str(log))
    append(log, line + "\n")
    watch.scan()
    assert watch.fatal == line


def test_lmcache_s_retried_full_sync_error_is_not_fatal(log):
    """Seen starting `kvctl serve --controller`: the controller's full sync reaches the engine before its
    storage exists; LMCache logs an ERROR and the next heartbeat carries the command again."""
    watch = LogWatch(str(log))
    append(log, "\x1b[31;20m[2026-12-04 19:01:51,820] LMCache ERROR:\x1b[0m Error executing command FullSyncCommand: "
                "'NoneType' object has no attribute 'local_cpu_backend' (worker.py:511:lmcache.v1.cache_controller)\n")
    watch.scan()
    assert watch.fatal is None
    append(log, "[2026-12-04 19:01:52,000] LMCache ERROR: Error executing command FullSyncCommand: timeout\n")
    watch.scan()
    assert "timeout" in watch.fatal  # any other failure of it still is


def test_errors_in_words_are_not_fatal(log):
    watch = LogWatch(str(log))
    append(log, "INFO error_rate=0 ERRORS=0 no_errors\n")
    watch.scan()
    assert watch.fatal is None


@pytest.mark.parametrize(("argv", "env", "inherited", "key"), [
    (["--api-key", "from-flag"], {"VLLM_API_KEY": "from-env"}, "inherited", "from-flag"),
    (["--api_key=from-flag"], {}, None, "from-flag"),
    ([], {"VLLM_API_KEY": "from-env"}, "inherited", "from-env"),
    ([], {}, "inherited", "inherited"),
    ([], {}, None, None),
])
def test_vllm_is_asked_with_its_api_key(monkeypatch, argv, env, inherited, key):
    if inherited:
        monkeypatch.setenv("VLLM_API_KEY", inherited)
    else:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    headers = _vllm_headers(Component("vllm", ["python", "-m", "vllm", *argv], env, "vllm.log"))
    assert headers == ({"Authorization": f"Bearer {key}"} if key else {})
