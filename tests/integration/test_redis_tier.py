"""kvctl's Redis presence client against a real redis-server."""

import pytest

from kvctl.clients.redis_tier import BATCH, RedisTier
from kvctl.core.errors import RejectedError, UnreachableError
from kvctl.core.lmcache.tiers import parse_redis_url
from tests.helpers import free_port


def test_exists_is_exact_across_batches_and_unicode_names(start_redis):
    server = start_redis()
    client = server.client()
    names = [f"m@1@0@{index:x}@halfmetadata" for index in range(BATCH + 10)] + ["modèle@1@0@ff@halfmetadata"]
    present = set(names[::3]) | {names[-1]}
    client.mset({name: b"1" for name in present})
    with RedisTier(parse_redis_url(server.url)) as tier:
        assert tier.exists(names) == [name in present for name in names]
        listed = tier.scan("m@*", 5)
        assert len(listed) == 5 and set(listed) <= present


def test_database_and_password_from_the_url(start_redis):
    server = start_redis(password="pw")
    import redis

    redis.Redis(port=server.port, password="pw", db=2).set("k", "1")
    with RedisTier(parse_redis_url(f"redis://:pw@127.0.0.1:{server.port}/2")) as tier:
        assert tier.exists(["k", "nope"]) == [True, False]
    with RedisTier(parse_redis_url(f"redis://:pw@127.0.0.1:{server.port}/0")) as tier:
        assert tier.exists(["k"]) == [False]
    with pytest.raises(RejectedError, match="refused the credentials"):
        RedisTier(parse_redis_url(f"redis://:wrong@127.0.0.1:{server.port}")).exists(["k"])
    with pytest.raises(RejectedError):
        RedisTier(parse_redis_url(f"redis://127.0.0.1:{server.port}")).exists(["k"])


def test_unreachable_redis():
    with pytest.raises(UnreachableError, match="cannot connect"):
        RedisTier(parse_redis_url(f"redis://127.0.0.1:{free_port()}")).exists(["k"])
