"""The CLI in process against in-memory instances: `kvctl(*argv)` runs it, `instances` is what the patched
open_instance hands out (`one` for a single instance, `members` a, b, c for --instance all)."""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import replace

import pytest
import typer.main

from kvctl.core.errors import ServerError
from kvctl.core.lmcache.keys import KeyRecipe, key_string
from tests.fast.memory import MemoryInstance, MemoryStore, memory_keys
from tests.helpers import run_cli

MODEL = "llama"
PROMPT = list(range(100, 116))  # 4 chunks
PROMPT_KEYS = memory_keys(PROMPT, MODEL)
OTHER_PROMPT = list(range(500, 508))  # 2 chunks, none stored
LLAMA = KeyRecipe(MODEL, chunk_size=4, kv_dtype="half")
OTHER_LLAMA = [key_string(LLAMA, 0xA1), key_string(LLAMA, 0xA2)]  # llama chunks of other prompts
LLAMA_V2 = [key_string(replace(LLAMA, model_name="llama@v2"), 0xB1)]  # another model, whose name starts alike
FOREIGN = ["llama@2024@12@report@half", "session:42"]  # look alike, are no chunk keys
REMOVAL_FAILS = ServerError("the disk tier answered 500", hint="see the server's log")
PROMPT_FILE = "<PROMPT's token-ids file>"  # an argument the kvctl fixture replaces by the file's path


def sample_stores() -> list[MemoryStore]:
    """cpu: the prompt's 4 chunks, 2 other llama chunks, one of llama@v2; disk: the prompt's first 2 and the
    llama@v2 one; both hold foreign names."""
    return [MemoryStore("cpu", PROMPT_KEYS + OTHER_LLAMA + LLAMA_V2 + FOREIGN),
            MemoryStore("disk", PROMPT_KEYS[:2] + LLAMA_V2 + FOREIGN)]


def contents(instance: MemoryInstance) -> dict[str, set[str]]:
    return {store.tier: set(store.names) for store in instance.stores}


def without(before: dict[str, set[str]], chunks: list[dict[str, str]]) -> dict[str, set[str]]:
    """What the stores hold once these chunks ({"tier", "key"}, as an eviction lists them) are gone."""
    return {tier: names - {chunk["key"] for chunk in chunks if chunk["tier"] == tier} for tier, names in before.items()}


class Instances:
    """What the patched kvctl.core.instance.opening.open_instance returns: `one` when no fleet member is named,
    else the member of that name (replace one to make it fail or hang)."""

    def __init__(self, tmp_path) -> None:
        self.one = MemoryInstance("memory", sample_stores())
        self.members = {name: MemoryInstance(name, sample_stores()) for name in "abc"}
        self.inventory = tmp_path / "kvctl.yaml"
        self.inventory.write_text("instances:\n" + "".join(
            f"  {name}: {{internal_api: http://127.0.0.1:1}}\n" for name in self.members))

    def fleet_contents(self) -> dict[str, dict[str, set[str]]]:
        return {name: contents(member) for name, member in self.members.items()}

    def open(self, selector, address=None):
        return self.one if address is None else self.members[address.name]

    @property
    def all(self) -> list[str]:
        """The flags that address every member."""
        return ["--inventory", str(self.inventory), "--instance", "all"]


@pytest.fixture
def instances(monkeypatch, tmp_path) -> Instances:
    chosen = Instances(tmp_path)
    monkeypatch.setattr("kvctl.core.instance.opening.open_instance", chosen.open)
    return chosen


# Typer builds the Click command from the functions' signatures on every run (tens of ms); one build serves all.
built_command = functools.cache(typer.main.get_command)


@pytest.fixture
def kvctl(monkeypatch, tokens_file):
    """kvctl run in process: a tests.helpers.Result. PROMPT_FILE in the arguments stands for a token-ids file
    of PROMPT. stdout is no terminal (JSON by default), nor is stdin; tables are wide enough that keys are
    not folded."""
    monkeypatch.delenv("KVCTL_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setattr(typer.main, "get_command", built_command)
    return lambda *args: run_cli(*(tokens_file() if arg == PROMPT_FILE else arg for arg in args))


@pytest.fixture
def tokens_file(tmp_path):
    """Writes token ids to a file and returns its path (PROMPT by default)."""
    def write(tokens=PROMPT, name="prompt.json"):
        path = tmp_path / name
        path.write_text(json.dumps(tokens))
        return str(path)
    return write


@pytest.fixture
def release():
    """Lets the members left hanging go once the test is done."""
    event = threading.Event()
    yield event
    event.set()
