"""`kvctl serve`'s launch plan from a configuration directory, asserted as the commands it would run (nothing
starts), and the port checks that refuse a plan before anything does."""

import os

import pytest

from kvctl.core.config.init import ConfigRequest, build_config, write_files
from kvctl.core.errors import UsageError
from kvctl.core.lmcache.tiers import parse_tier
from kvctl.core.serve.launch import build_plan, preflight, world_size
from tests.helpers import free_port


@pytest.fixture(autouse=True)
def clean_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def config_dir(tmp_path, seed: str | None = None, **request):
    """A `kvctl config init` directory; `seed` replaces the PYTHONHASHSEED it writes to env.sh."""
    out = tmp_path / "cfg"
    files = build_config(ConfigRequest(tiers=[parse_tier("cpu:1")], **request), out).render(out)
    if seed is not None:
        files["env.sh"] = files["env.sh"].replace("PYTHONHASHSEED=0", f"PYTHONHASHSEED={seed}")
    write_files(files, out, force=False)
    return out


def component(plan, name):
    return next(part for part in plan.components if part.name == name)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def ports(plan):
    return [(use.port, use.host, use.owner) for use in plan.ports]


def test_an_inprocess_configuration_gives_every_rank_its_api_port_from_the_file(tmp_path):
    config = config_dir(tmp_path, seed="123", internal_api_port_start=7100)
    plan = build_plan(model="org/m", tiers=[], config=config, port=18000, internal_api_port_start=6999,
                      extra_vllm_args=["-tp", "2", "--pipeline_parallel_size=2"], write=False)
    assert plan.mode == "inprocess" and plan.config_dir == str(config)
    assert ports(plan) == [(18000, "127.0.0.1", "vLLM"), (7100, "127.0.0.1", "LMCache's scheduler API")] + [
        (7101 + rank, "127.0.0.1", f"LMCache's worker {rank} API") for rank in range(4)]
    assert plan.endpoints["internal_api"] == [f"http://127.0.0.1:{port}" for port in range(7100, 7105)]
    (vllm,) = plan.components
    assert vllm.env["PYTHONHASHSEED"] == "123"  # the seed the chunk keys depend on, from env.sh
    assert vllm.env["LMCACHE_CONFIG_FILE"] == str(config / "lmcache.yaml")
    assert flag(vllm.argv, "--model") == "org/m"
    assert vllm.argv[-3:] == ["-tp", "2", "--pipeline_parallel_size=2"]


def test_an_mp_configuration_is_served_in_mp_mode_on_its_own_ports(tmp_path):
    config = config_dir(tmp_path, mode="mp", mp_port=15601, mp_http_port=18601)
    plan = build_plan(model="org/m", tiers=[], config=config, port=18000, coordinator_port=19300, write=False)
    assert plan.mode == "mp"
    assert [part.name for part in plan.components] == ["lmcache-coordinator", "lmcache-server", "vllm"]
    assert ports(plan) == [(18000, "127.0.0.1", "vLLM"), (19300, "127.0.0.1", "the LMCache coordinator"),
                           (15601, "127.0.0.1", "the MP server's request port"),
                           (18601, "127.0.0.1", "the MP server's HTTP port")]
    server = component(plan, "lmcache-server").argv
    assert (flag(server, "--host"), flag(server, "--port")) == ("127.0.0.1", "15601")
    assert (flag(server, "--http-host"), flag(server, "--http-port")) == ("127.0.0.1", "18601")
    assert flag(server, "--coordinator-url") == "http://127.0.0.1:19300"
    assert plan.endpoints["mp_http"] == "http://127.0.0.1:18601"


def test_vllm_on_every_interface_leaves_kvctls_own_servers_on_loopback(tmp_path):
    plan = build_plan(model="org/m", mode="mp", tiers=[parse_tier("cpu:1")], config=None, host="0.0.0.0", port=18000,
                      write=False)
    vllm = component(plan, "vllm")
    assert flag(vllm.argv, "--host") == "0.0.0.0"
    assert vllm.ready[0].target == "http://127.0.0.1:18000/v1/models"  # a wildcard bind is reached on loopback
    assert flag(component(plan, "lmcache-coordinator").argv, "--host") == "127.0.0.1"
    server = component(plan, "lmcache-server").argv
    assert flag(server, "--host") == flag(server, "--http-host") == flag(server, "--coordinator-advertise-ip") \
        == "127.0.0.1"
    assert {use.host for use in plan.ports[1:]} == {"127.0.0.1"}


@pytest.mark.parametrize("mode", ["inprocess", "mp"])
def test_inherited_lmcache_variables_reach_no_child(monkeypatch, mode):
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "redis://elsewhere:6379")
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "16")
    monkeypatch.setenv("LMCACHE_TRACK_USAGE", "true")  # kvctl sets its own value
    plan = build_plan(model="org/m", mode=mode, tiers=[parse_tier("cpu:1")], config=None, write=False)
    assert plan.unset_env == ["LMCACHE_CHUNK_SIZE", "LMCACHE_REMOTE_URL"]
    for part in plan.components:
        assert "LMCACHE_REMOTE_URL" not in part.env and "LMCACHE_CHUNK_SIZE" not in part.env, part.name
        assert part.env["LMCACHE_TRACK_USAGE"] == "false" and part.env["LMCACHE_DISABLE_BANNER"] == "1"


@pytest.mark.parametrize(("args", "size"), [
    ([], 1), (["-tp", "2"], 2), (["--tensor-parallel-size=4"], 4), (["--tensor_parallel_size", "2", "-pp", "3"], 6),
    (["-tp", "2", "--tensor-parallel-size", "8"], 8),  # the last one given wins, as in vLLM
])
def test_world_size_from_vllm_flags(args, size):
    assert world_size(args) == size


@pytest.mark.parametrize("value", ["0", "-1", "2.5"])
def test_a_parallel_size_that_is_no_positive_number_is_refused(value):
    with pytest.raises(UsageError, match="--pipeline-parallel-size .* is not a positive number"):
        world_size(["--pipeline-parallel-size", value])


def refusal(plan) -> str:
    with pytest.raises(UsageError) as refused:
        preflight(plan)
    assert refused.value.hint.startswith("choose other ports")
    return refused.value.message


def mp_plan(**ports_):
    return build_plan(model="org/m", mode="mp", tiers=[parse_tier("cpu:1")], config=None, write=False, **ports_)


def test_every_owner_of_a_colliding_port_is_named():
    message = refusal(mp_plan(port=18100, mp_http_port=18100, coordinator_port=18100, mp_port=15600))
    assert message == ("ports collide in this plan: 18100 is taken by vLLM and by the LMCache coordinator and by the "
                       "MP server's HTTP port")


def test_every_collision_is_named_at_once():
    message = refusal(mp_plan(port=15600, mp_port=15600, mp_http_port=18100, coordinator_port=18100))
    assert message == ("ports collide in this plan: 15600 is taken by vLLM and by the MP server's request port; "
                       "18100 is taken by the LMCache coordinator and by the MP server's HTTP port")


@pytest.mark.parametrize(("ports_", "message"), [
    ({"port": 0}, "port 0 (vLLM) is out of range"),
    ({"mp_http_port": 70000}, "port 70000 (the MP server's HTTP port) is out of range"),
    ({"coordinator_port": 65536}, "port 65536 (the LMCache coordinator) is out of range"),
])
def test_ports_out_of_range_are_refused(ports_, message):
    assert refusal(mp_plan(**{"port": 18100, "mp_port": 15600, "mp_http_port": 18101, "coordinator_port": 18102,
                              **ports_})) == message


def test_a_plan_on_free_ports_passes(tmp_path):
    start = free_port(3)
    plan = build_plan(model=None, tiers=[parse_tier("cpu:1")], config=None, port=free_port(1),
                      internal_api_port_start=start, write=False)
    preflight(plan)  # refuses by raising
    assert [use.port for use in plan.ports[1:]] == [start, start + 1]


@pytest.mark.parametrize(("model", "extra", "eager"), [
    (None, [], True),  # the embedded default, before it is built
    ("tiny-by-path", [], True),
    ("tiny-by-path", ["-O3"], False),  # the user's own compilation choice wins
    ("tiny-by-path", ["--compilation-config", "{}"], False),
    ("org/m", [], False),  # a real model keeps vLLM's default (compiled)
])
def test_the_tiny_model_is_served_eagerly_unless_told(tmp_path, model, extra, eager):
    from kvctl.core.serve.tiny_model import MARKER

    if model == "tiny-by-path":
        model = tmp_path / "tiny"
        model.mkdir()
        (model / MARKER).write_text("")
    plan = build_plan(model=model and str(model), mode="mp", tiers=[parse_tier("cpu:1")], config=None, write=False,
                      extra_vllm_args=extra)
    argv = component(plan, "vllm").argv
    assert ("--enforce-eager" in argv) is eager
    assert argv.count("--enforce-eager") <= 1
    assert ("--kv-cache-memory-bytes" in argv) is (model != "org/m")  # the tiny model's KV cache is small


def test_the_users_own_kv_cache_size_wins_for_the_tiny_model(tmp_path):
    from kvctl.core.serve.tiny_model import MARKER

    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / MARKER).write_text("")
    plan = build_plan(model=str(tmp_path / "tiny"), mode="mp", tiers=[parse_tier("cpu:1")], config=None, write=False,
                      extra_vllm_args=["--kv-cache-memory-bytes=1073741824"])
    argv = component(plan, "vllm").argv
    assert [arg for arg in argv if arg.startswith("--kv-cache-memory-bytes")] == ["--kv-cache-memory-bytes=1073741824"]
