"""#20 item 10: `kvctl conf set` refuses the values LMCache takes and then misbehaves on (a
blocking_timeout_secs below 1 times out every Redis get), before any engine is asked."""

import pytest

from kvctl.core.admin import manage
from kvctl.core.errors import UsageError


@pytest.mark.parametrize("word", ["blocking_timeout_secs=-1", "blocking_timeout_secs=0",
                                  "blocking_timeout_secs=99999999999", "min_retrieve_tokens=-1"])
def test_out_of_range_live_values_are_refused(word):
    with pytest.raises(UsageError, match="is out of range"):
        manage.parse_assignments([word])


def test_the_bounds_keep_the_useful_values():
    assert manage.parse_assignments(["blocking_timeout_secs=1", "min_retrieve_tokens=0", "priority_limit=-3"]) == \
        {"blocking_timeout_secs": 1, "min_retrieve_tokens": 0, "priority_limit": -3}


def test_every_bounded_key_is_a_number_kvctl_lets_conf_set_change():
    from kvctl.core.lmcache.config import BOUNDS

    assert set(BOUNDS) <= set(manage.LIVE_KEYS)
