"""The LMCache-internal names kvctl's plugins rely on: all present in the installed LMCache (0.5.6), and
one that is not stops an engine at start in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvctl_plugins import lmcache_names

from tests.helpers import STACK_ENV, run_kvctl, standalone_argv


@pytest.mark.slow  # imports LMCache (seconds): kept out of make test-fast
def test_every_name_the_plugins_use_is_in_the_installed_lmcache():
    assert lmcache_names.missing(lmcache_names.IN_PROCESS) is None
    assert lmcache_names.missing(lmcache_names.MP_SERVER) is None
    assert lmcache_names.missing([("lmcache.utils", "CacheEngineKey.no_such_method")]) == \
        "lmcache.utils:CacheEngineKey.no_such_method"
    assert lmcache_names.missing([("lmcache.no_such_module", "")]) == "lmcache.no_such_module"


@pytest.mark.slow
def test_an_engine_whose_lmcache_lacks_a_name_stops_at_start_in_one_line(tmp_path):
    assert run_kvctl("config", "init", "--out", tmp_path / "cfg").code == 0
    moved = ("import sys, runpy, kvctl_plugins.lmcache_names as names; "
             "names.IN_PROCESS += (('lmcache.utils', 'CacheEngineKeyMoved'),); "
             "runpy.run_module('kvctl_plugins.standalone', run_name='__main__')")
    argv = [sys.executable, "-c", moved, *standalone_argv(tmp_path / "cfg")[3:]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **STACK_ENV})
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvctl plugins: LMCache 0.5.6 has no lmcache.utils:CacheEngineKeyMoved"), last
    assert "hint: install lmcache==0.5.6" in last
