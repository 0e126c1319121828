"""kvctl's chunk keys equal the keys real LMCache code makes, for every hash algorithm and both modes."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.core.lmcache.keys import (
    INPROCESS_ALGORITHMS,
    MP_ALGORITHMS,
    KeyRecipe,
    MPKeyRecipe,
    UnreproducibleKeys,
    chunk_bounds,
    inprocess_keys,
    mp_chunk_hashes,
)
from tests.helpers import STACK_ENV

SCRIPT = Path(__file__).parent / "scripts" / "lmcache_keys.py"
TOKENS = random.Random(7).choices(range(50000), k=700)


def lmcache_keys(cases, seed="0", vllm=True):
    """Keys from real LMCache code in one child process whose PYTHONHASHSEED is `seed` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update({**STACK_ENV, "LMCACHE_LOG_LEVEL": "ERROR"})
    env.pop("PYTHONHASHSEED")
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    done = subprocess.run([sys.executable, str(SCRIPT), "1" if vllm else "0"], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def inprocess_case(algorithm, chunk=256, save_unfull=False, model="org/model", world_size=2, dtype="bfloat16"):
    return {"mode": "inprocess", "algorithm": algorithm, "chunk": chunk, "save_unfull": save_unfull, "model": model,
            "world_size": world_size, "dtype": dtype, "tokens": TOKENS}


def assert_same(case, expected, seed, vllm):
    for worker, worker_keys in enumerate(expected):
        recipe = KeyRecipe(case["model"], case["chunk"], case["algorithm"], seed, vllm, case["save_unfull"],
                           case["world_size"], worker, {"bfloat16": "bfloat16", "float16": "half"}[case["dtype"]])
        bounds = chunk_bounds(len(TOKENS), case["chunk"], case["save_unfull"])
        assert ([[s, e, k] for (s, e), k in zip(bounds, inprocess_keys(TOKENS, recipe))]
                == worker_keys), case["algorithm"]


def mp_case(algorithm):
    return {"mode": "mp", "algorithm": algorithm, "chunk": 256, "tokens": TOKENS}


INPROCESS_CASES = [inprocess_case(algorithm) for algorithm in INPROCESS_ALGORITHMS] + [
    inprocess_case("sha256_cbor", chunk=128, save_unfull=True, model="tiny", world_size=1, dtype="float16")]
PLUGIN_CASES = [inprocess_case(algorithm, save_unfull=save_unfull, world_size=1)
                for algorithm in INPROCESS_ALGORITHMS for save_unfull in (False, True)]
WITHOUT_VLLM_CASES = [inprocess_case(algorithm, chunk=128, save_unfull=True, world_size=1)
                      for algorithm in ("builtin", "sha256_cbor")]
MP_CASES = [mp_case(algorithm) for algorithm in MP_ALGORITHMS]
MP_BUILTIN = mp_case("builtin")


def grouped(*groups, **child):
    """The answers to `groups` of cases from one child process (each is an lmcache + vLLM import, ~10 CPU-s),
    split back into their groups. The MP cases go first, as in a server, before any in-process database."""
    answers = iter(lmcache_keys([case for group in groups for case in group], **child))
    return [[next(answers) for _ in group] for group in groups]


def through_plugin(cases):
    return [{**case, "plugin": True} for case in cases]


@pytest.fixture(scope="module")
def seed_zero():
    """Every seed-0 case with vLLM: MP, MP builtin twice, in-process, then each plugin case plain and keyed by
    the plugin (the plugin cases last)."""
    return grouped(MP_CASES, [MP_BUILTIN, MP_BUILTIN], INPROCESS_CASES, PLUGIN_CASES, through_plugin(PLUGIN_CASES))


@pytest.fixture(scope="module")
def without_vllm():
    """Every case of an engine process without vLLM: in-process, then each plugin case plain and by the plugin."""
    return grouped(WITHOUT_VLLM_CASES, PLUGIN_CASES, through_plugin(PLUGIN_CASES), vllm=False)


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["0", "12345"])
def test_inprocess_keys_with_vllm_importable(seed, request):
    answers = request.getfixturevalue("seed_zero")[2] if seed == "0" else lmcache_keys(INPROCESS_CASES, seed=seed)
    for case, expected in zip(INPROCESS_CASES, answers, strict=True):
        assert len(expected) == case["world_size"] and expected[0]
        assert_same(case, expected, seed, vllm=True)


@pytest.mark.slow
def test_inprocess_keys_without_vllm(without_vllm):
    for case, expected in zip(WITHOUT_VLLM_CASES, without_vllm[0], strict=True):
        assert expected[0][-1][:2] == [640, 700]  # the unfull tail is a chunk of its own
        assert_same(case, expected, "0", vllm=False)


@pytest.mark.slow
@pytest.mark.parametrize("vllm", [True, False])
def test_the_plugin_route_makes_the_engine_keys(vllm, request):
    """Inside the engine, kvctl's routes key a prompt by the compiled chain where the engine's own hash agrees
    (builtin, sha256_cbor, xxhash_cbor with vLLM), else by process_tokens: the same keys either way."""
    answers = request.getfixturevalue("seed_zero" if vllm else "without_vllm")
    for case, engine, plugin in zip(PLUGIN_CASES, answers[-2], answers[-1], strict=True):
        assert plugin[0]["keys"] == engine[0] and len(engine[0]) >= 2, case
        # without vLLM LMCache hashes every algorithm with hash(): the check refuses the CBOR chain then
        compiled = case["algorithm"] == "builtin" or (vllm and case["algorithm"] in ("sha256_cbor", "xxhash_cbor"))
        assert plugin[0]["compiled"] == compiled, case


@pytest.mark.slow
def test_keys_of_a_process_without_seed():
    """sha256 functions fall back to vLLM's fixed seed; builtin keys cannot be reproduced (kvctl says so)."""
    case = inprocess_case("sha256_cbor")
    assert_same(case, lmcache_keys([case], seed=None)[0], None, vllm=True)


@pytest.mark.slow
def test_mp_chunk_hashes(seed_zero):
    for case, expected in zip(MP_CASES, seed_zero[0], strict=True):
        assert len(expected) == 2
        assert [h.hex() for h in mp_chunk_hashes(TOKENS, MPKeyRecipe("m", 256, case["algorithm"], "0"))] == expected


@pytest.mark.slow
def test_mp_builtin_keys_change_with_every_server_process(seed_zero):
    """Why kvctl refuses MP `builtin`: LMCache hashes (prefix, tokens, None) and hash(None) is an address."""
    first, (second,) = seed_zero[1], lmcache_keys([MP_BUILTIN])
    assert first[0] == first[1] and first[0] != second
    with pytest.raises(UnreproducibleKeys):
        mp_chunk_hashes(TOKENS, MPKeyRecipe("m", 256, "builtin", "0"))
