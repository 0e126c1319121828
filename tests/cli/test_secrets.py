"""A Redis password given to kvctl stays secret: owner-only files, off command lines, *** wherever kvctl prints."""

import json
import stat
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import run_cli

PASSWORD = "hunter2"


@pytest.fixture(autouse=True)
def kvctl_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("LMCACHE_CONFIG_FILE", "LMCACHE_REMOTE_URL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mode_", "tier"), [("inprocess", f"rediss://u:{PASSWORD}@h:6380/1"),
                                             ("mp", f"redis://u:{PASSWORD}@127.0.0.1:6390")])
def test_config_init_writes_owner_only_files(tmp_path, mode_, tier):
    result = run_cli("config", "init", "--out", tmp_path / "cfg", "--mode", mode_, "--tier", "cpu:1", "--tier", tier)
    assert result.code == 0, result.stderr
    files = sorted((tmp_path / "cfg").iterdir())
    assert [path.name for path in files] == ["env.sh", "kv-transfer-config.json", "lmcache.yaml"]
    assert {path.name: mode(path) for path in files} == dict.fromkeys((path.name for path in files), 0o600)
    assert PASSWORD in (tmp_path / "cfg" / "lmcache.yaml").read_text()  # the file works: it holds the password
    assert PASSWORD not in result.stdout + result.stderr


def test_mp_server_gets_the_redis_password_in_its_environment_not_its_command_line(tmp_path):
    from kvctl.core.lmcache.tiers import parse_tier
    from kvctl.core.serve.launch import build_plan

    tiers = [parse_tier("cpu:1"), parse_tier(f"redis://alice:{PASSWORD}@127.0.0.1:6390")]
    server = build_plan(model=None, mode="mp", tiers=tiers, config=None, start_coordinator=False,
                        write=False).components[0]
    assert server.name == "lmcache-server"
    assert not any(PASSWORD in arg for arg in server.argv)
    adapter = json.loads(server.argv[server.argv.index("--l2-adapter") + 1])
    assert adapter == {"type": "resp", "host": "127.0.0.1", "port": 6390}
    assert (server.env["LMCACHE_RESP_USERNAME"], server.env["LMCACHE_RESP_PASSWORD"]) == ("alice", PASSWORD)


def test_serve_dry_run_never_prints_the_password(tmp_path):
    tier = f"redis://alice:{PASSWORD}@127.0.0.1:6390"
    as_json = run_cli("serve", "--dry-run", "--mode", "mp", "--tier", "cpu:1", "--tier", tier, "--format", "json",
                      "--", "--api-key", PASSWORD, f"--hf-token={PASSWORD}")
    assert as_json.code == 0, as_json.stderr
    _coordinator, server, vllm = as_json.json()["components"]
    assert server["env"]["LMCACHE_RESP_PASSWORD"] == "***"
    assert vllm["argv"][-3:] == ["--api-key", "***", "--hf-token=***"]
    as_table = run_cli("serve", "--dry-run", "--mode", "mp", "--tier", "cpu:1", "--tier", tier, "--format", "table")
    assert as_table.code == 0 and "LMCACHE_RESP_PASSWORD='***'" in as_table.stdout
    assert PASSWORD not in as_json.stdout + as_json.stderr + as_table.stdout + as_table.stderr


def test_serve_dry_run_of_a_config_directory_redacts_urls_in_vllm_arguments(tmp_path):
    assert run_cli("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:1").code == 0
    transfer = tmp_path / "cfg" / "kv-transfer-config.json"
    config = json.loads(transfer.read_text())
    config["kv_connector_extra_config"] = {"lmcache.remote_url": f"redis://:{PASSWORD}@h:1"}
    transfer.write_text(json.dumps(config))
    result = run_cli("serve", "--config", tmp_path / "cfg", "--dry-run", "--format", "json")
    assert result.code == 0, result.stderr
    argv = result.json()["components"][0]["argv"]
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"] == {
        "lmcache.remote_url": "redis://:***@h:1"}
    assert PASSWORD not in result.stdout


@pytest.mark.parametrize("url", [f"rediss://u:{PASSWORD}@h:6380", f"redis-sentinel://:{PASSWORD}@a:1,b:2/m",
                                 f"unix://:{PASSWORD}@/run/redis.sock", f"redis://h:6379/0?password={PASSWORD}",
                                 f"s3://AKIA:{PASSWORD}@bucket"])
def test_config_show_redacts_urls_of_every_scheme(tmp_path, url):
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump({"remote_url": url, "extra_config": {"backup": url}}))
    for fmt in ("json", "table"):
        result = run_cli("config", "show", path, "--format", fmt)
        assert result.code == 0, result.stderr
        assert PASSWORD not in result.stdout + result.stderr and "***" in result.stdout


def test_config_show_of_an_mp_configuration_keeps_the_password_out_of_the_command(tmp_path):
    init = run_cli("config", "init", "--out", tmp_path / "cfg", "--mode", "mp", "--tier", "cpu:1", "--tier",
                   f"redis://u:{PASSWORD}@127.0.0.1:6390")
    assert init.code == 0
    header = (tmp_path / "cfg" / "lmcache.yaml").read_text().split("\n\n")[0]
    assert PASSWORD not in header and "LMCACHE_RESP_PASSWORD" in header
    shown = run_cli("config", "show", tmp_path / "cfg", "--format", "json")
    assert shown.code == 0 and PASSWORD not in shown.stdout
    payload = shown.json()
    assert payload["values"]["l2_adapter"][0]["password"] == "***"
    assert "password" not in " ".join(payload["command"])


def test_mp_resp_adapters_with_different_passwords_are_refused(tmp_path):
    path = tmp_path / "lmcache.yaml"
    adapters = [{"type": "resp", "host": "a", "port": 1, "password": PASSWORD},
                {"type": "resp", "host": "b", "port": 2, "password": "other"}]
    path.write_text(yaml.safe_dump({"port": 5555, "l1_size_gb": 1, "eviction_policy": "LRU", "l2_adapter": adapters}))
    result = run_cli("config", "show", path)
    assert result.code == 2
    assert result.stderr.splitlines()[0].startswith("error: resp L2 adapters with different credentials")
    assert result.stderr.splitlines()[1].startswith("hint: ") and PASSWORD not in result.stderr


@pytest.mark.parametrize("args", [
    ("config", "init", "--tier", f"redis://u:{PASSWORD}@h:notaport"),
    ("config", "init", "--tier", f"redis://u:{PASSWORD}@h:1/db"),
    ("config", "init", "--tier", f"http://u:{PASSWORD}@h:1"),
    ("config", "init", "--mode", "mp", "--tier", f"rediss://u:{PASSWORD}@h:1"),
    ("serve", "--dry-run", "--tier", f"redis://u:{PASSWORD}@h:99999"),
])
def test_errors_about_a_url_do_not_repeat_its_password(tmp_path, args):
    result = run_cli(*args, "--out", tmp_path / "cfg") if args[0] == "config" else run_cli(*args)
    assert result.code == 2
    assert result.stderr.startswith("error: ") and result.stderr.splitlines()[1].startswith("hint: ")
    assert PASSWORD not in result.stderr and "***" in result.stderr


def test_validate_findings_do_not_repeat_a_password(tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump({"remote_url": f"redis://u:{PASSWORD}@h:notaport",
                                    "local_cpu": f"redis://u:{PASSWORD}@h:1"}))
    result = run_cli("config", "validate", path, "--no-lmcache", "--format", "table")
    assert result.code == 1 and "bad port" in result.stdout and "is not a boolean" in result.stdout
    assert PASSWORD not in result.stdout + result.stderr


def test_serve_logs_are_owner_only(tmp_path):
    from kvctl.core.serve.launch import Component, LaunchPlan
    from kvctl.core.serve.supervisor import Supervisor, log_tail

    older = tmp_path / "logs" / "old.log"
    older.parent.mkdir()
    older.write_text("left by an older kvctl\n")
    older.chmod(0o644)
    components = [Component(name, [sys.executable, "-c", f"print('{name} says redis://u:{PASSWORD}@h:1')"], {},
                            str(tmp_path / "logs" / f"{name}.log")) for name in ("new", "old")]
    supervisor = Supervisor(LaunchPlan("t", "inprocess", "m", str(tmp_path), str(tmp_path / "s.json"), components, {}))
    supervisor.start()
    for process in supervisor.processes.values():
        process.wait(30)
    supervisor.stop()
    for name in ("new", "old"):
        log = tmp_path / "logs" / f"{name}.log"
        assert mode(log) == 0o600 and f"{name} says" in log.read_text()
    assert log_tail(str(tmp_path / "logs" / "new.log")) == "new says redis://u:***@h:1"
