"""A kvctl.yaml found by looking (in whatever directory kvctl runs) is announced, and never decides
where token ids go over a server's own coordinator."""

import yaml

from kvctl.core.instance.mp import coordinator_url
from tests.helpers import edit_yaml, run_cli, run_kvctl


def test_an_inventory_found_by_looking_is_announced_once(tmp_path):
    (tmp_path / "kvctl.yaml").write_text(yaml.safe_dump({"instances": {"x": {"internal_api": "http://127.0.0.1:1"}}}))
    result = run_kvctl("health", "--instance", "x", "--format", "json", cwd=tmp_path,
                       env={"KVCTL_INVENTORY": "", "XDG_CONFIG_HOME": str(tmp_path / "home")})
    assert result.code == 3
    assert result.stderr.count("using the inventory kvctl.yaml") == 1
    named = run_kvctl("health", "--instance", "x", "--inventory", tmp_path / "kvctl.yaml", "--format", "json",
                      env={"XDG_CONFIG_HOME": str(tmp_path / "home")})
    assert named.code == 3 and "using the inventory" not in named.stderr  # asked for by name: nothing to say


def test_the_servers_own_coordinator_wins_over_an_inventory(tmp_path, monkeypatch):
    assert run_cli("config", "init", "--mode", "mp", "--out", tmp_path / "cfg").code == 0
    edit_yaml(tmp_path / "cfg" / "lmcache.yaml", coordinator_url="http://127.0.0.1:9300")
    (tmp_path / "kvctl.yaml").write_text(yaml.safe_dump({"instances": {}, "coordinator": "http://127.0.0.1:6666"}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCTL_INVENTORY", "")
    assert coordinator_url(None, str(tmp_path / "cfg")) == "http://127.0.0.1:9300"
    assert coordinator_url("http://127.0.0.1:7777", str(tmp_path / "cfg")) == "http://127.0.0.1:7777"
    assert coordinator_url(None, None) == "http://127.0.0.1:6666"  # no server configuration known: the inventory's


def test_an_alias_bomb_in_the_inventory_is_refused(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(8))
    (tmp_path / "inventory.yaml").write_text(bomb)
    result = run_kvctl("health", "--instance", "all", "--inventory", tmp_path / "inventory.yaml", timeout=30)
    assert result.code == 1 and "hint:" in result.stderr and "Traceback" not in result.stderr
