import pytest

from kvctl.core.common.display import redact_url
from kvctl.core.errors import ExitCode, UsageError
from kvctl.core.lmcache.tiers import parse_redis_url, parse_tier


@pytest.mark.parametrize(
    ("url", "hosts", "user", "password", "db", "tls"),
    [
        ("redis://127.0.0.1:6390", ((("127.0.0.1", 6390),)), None, None, 0, False),
        ("redis://localhost", ((("localhost", 6379),)), None, None, 0, False),
        ("redis://:s3cret@10.0.0.1:7000/3", ((("10.0.0.1", 7000),)), None, "s3cret", 3, False),
        ("redis://alice:pa%40ss@h:1/0", ((("h", 1),)), "alice", "pa@ss", 0, False),
        ("rediss://h:6380", ((("h", 6380),)), None, None, 0, True),
        ("redis://[::1]:6390", ((("::1", 6390),)), None, None, 0, False),
        ("redis-cluster://a:1,b:2,c", ((("a", 1), ("b", 2), ("c", 6379))), None, None, 0, False),
    ],
)
def test_redis_urls_parse(url, hosts, user, password, db, tls):
    parsed = parse_redis_url(url)
    assert parsed.hosts == hosts
    assert (parsed.username, parsed.password, parsed.db, parsed.tls) == (user, password, db, tls)


def test_sentinel_url_keeps_service_name_and_default_port():
    parsed = parse_redis_url("redis-sentinel://u:p@s1:26380,s2/mymaster")
    assert parsed.hosts == (("s1", 26380), ("s2", 26379))
    assert parsed.service_name == "mymaster"
    assert parsed.url() == "redis-sentinel://u:p@s1:26380,s2:26379/mymaster"


@pytest.mark.parametrize("url", ["http://h:1", "redis://h:notaport", "redis://h:99999", "redis://", "redis://h/x"])
def test_bad_redis_urls_are_usage_errors_with_hints(url):
    with pytest.raises(UsageError) as caught:
        parse_redis_url(url)
    assert caught.value.exit_code == ExitCode.USAGE
    assert caught.value.hint


def test_redaction_hides_only_the_password():
    assert redact_url("redis://bob:hunter2@h:1/2") == "redis://bob:***@h:1/2"
    assert "hunter2" not in redact_url("redis-sentinel://:hunter2@a:1,b:2/m")
    assert redact_url("not a url") == "not a url"


def test_tier_specs():
    assert parse_tier("cpu").size_gb is None
    assert parse_tier("cpu:2.5").size_gb == 2.5
    disk = parse_tier("disk:/var/cache/kv:50")
    assert (disk.name, disk.path, disk.size_gb) == ("disk", "/var/cache/kv", 50.0)
    assert parse_tier("disk:/data/with:colon").path == "/data/with:colon"
    redis = parse_tier("redis://h:1")
    assert redis.name == "redis" and redis.redis.hosts == (("h", 1),)


@pytest.mark.parametrize("text", ["gpu:4", "cpu:-1", "cpu:lots", "disk", "disk::5"])
def test_bad_tier_specs(text):
    with pytest.raises(UsageError):
        parse_tier(text)
