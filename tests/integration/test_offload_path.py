"""kvctl derives the offload socket path exactly as LMCache does, and refuses messages that would stall it."""

import os
import subprocess
import sys

import pytest

from kvctl.clients.offload import OffloadClient, offload_socket_path, validate_offload
from kvctl.core.errors import UnreachableError, UsageError
from tests.helpers import STACK_ENV


@pytest.mark.slow
def test_paths_equal_lmcaches(tmp_path):
    long_base = "/tmp/" + "x" * 70  # too long for the descriptive name, short enough for the digest
    cases = [("engine-1", 0, 100, "/tmp"), ("29b12118-1ebc-446b-8755-8588f8a5d43d", 3, 7000, "/tmp"),
             ("e", 1, 100, long_base)]
    code = ("import sys, json; from lmcache.v1.rpc_utils import get_zmq_rpc_path_lmcache as p; "
            "print(json.dumps([p(e, 'offload', port, rank, base) for e, rank, port, base in json.loads(sys.argv[1])]))")
    import json

    done = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True,
                          env={**os.environ, **STACK_ENV, "LMCACHE_LOG_LEVEL": "ERROR"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    assert [offload_socket_path(e, rank, port, base) for e, rank, port, base in cases] == expected
    assert os.path.basename(expected[2]).startswith("lmcache_rpc_")  # the 107-byte fallback was exercised


@pytest.mark.parametrize(("hashes", "slots", "offsets", "words"), [
    ([1], [0, 1], [3], "cover 3 tokens"),
    ([1, 2], [0], [1], "2 hashes but 1 offsets"),
    ([1], [-1], [1], "slot_mapping has values"),
    (["a"], [0], [1], "hashes must be a list of integers"),
    ([1], [0], [0], "offsets has values"),
])
def test_bad_offload_messages_are_refused_before_sending(hashes, slots, offsets, words, tmp_path):
    with pytest.raises(UsageError, match=words):
        OffloadClient(str(tmp_path / "never-used")).offload(hashes, slots, offsets)


def test_missing_socket_is_unreachable(tmp_path):
    validate_offload([1], [5], [1])
    with pytest.raises(UnreachableError, match="no offload socket"):
        OffloadClient(str(tmp_path / "absent")).health()
