"""#20 item 10: `kvctl quota set` that lowers a quota evicts like `quota rm`, so it asks first (or needs
--yes); against a real `lmcache server`."""

import pytest

from tests.integration.test_manage import answer, kvctl, mp_server  # noqa: F401  (mp_server: the fixture)


@pytest.mark.slow
def test_lowering_a_quota_asks_and_raising_one_does_not(mp_server):  # noqa: F811
    assert answer(mp_server, "quota", "set", "tenant-b", "2.5")["status"] == "ok"  # a new quota: nothing shrinks
    assert answer(mp_server, "quota", "set", "tenant-b", "5")["quotas"][0]["limit_gb"] == 5
    for lower in ("0", "1"):
        refused = kvctl(mp_server, "quota", "set", "tenant-b", lower)  # not on a terminal, no --yes
        assert refused.code == 2 and "refusing to lower the quota of tenant-b from 5 GB" in refused.stderr
        assert "hint: add --yes" in refused.stderr and "Traceback" not in refused.stderr
        assert answer(mp_server, "quota", "get", "tenant-b")["quotas"][0]["limit_gb"] == 5  # unchanged
    assert answer(mp_server, "quota", "set", "tenant-b", "0", "--yes")["quotas"][0]["limit_gb"] == 0
    assert kvctl(mp_server, "quota", "set", "tenant-b", "inf", "--yes").code == 2
    assert answer(mp_server, "quota", "rm", "tenant-b", "--yes")["status"] == "removed"
