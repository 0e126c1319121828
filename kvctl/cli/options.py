"""Choices and option types shared by every command group, so flags mean the same everywhere."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


class Mode(str, Enum):
    inprocess = "inprocess"
    mp = "mp"


class HashAlgorithm(str, Enum):
    builtin = "builtin"
    sha256 = "sha256"
    sha256_cbor = "sha256_cbor"
    xxhash = "xxhash"
    xxhash_cbor = "xxhash_cbor"
    blake3 = "blake3"


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


class PrefetchTier(str, Enum):
    disk = "disk"
    redis = "redis"


class Tier(str, Enum):
    cpu = "cpu"
    disk = "disk"
    redis = "redis"
    all = "all"


InstanceOption = Annotated[str | None, typer.Option(
    "--instance", help="A running instance: a 'kvctl serve --name' or inventory name, or a URL (worker 0's internal "
    "API, or the lmcache server's HTTP API).")]
FleetInstance = Annotated[str | None, typer.Option(
    "--instance", help="'all' (every instance of the inventory), an inventory or 'kvctl serve --name' name, or a URL "
    "(worker 0's internal API, or the lmcache server's HTTP API; default: the most recent kvctl serve).")]
StateOption = Annotated[Path | None, typer.Option("--state", help="The state file of a 'kvctl serve' (default: the "
                                                  "most recent one).")]
InventoryOption = Annotated[Path | None, typer.Option(
    "--inventory", help="A kvctl.yaml fleet inventory (default: $KVCTL_INVENTORY, ./kvctl.yaml, "
    "~/.config/kvctl/kvctl.yaml).")]
TimeoutOption = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds each instance gets.")]
TierOption = Annotated[list[Tier] | None, typer.Option("--tier", help="cpu, disk, redis or all (repeatable).")]
PromptFile = Annotated[str | None, typer.Option("--prompt-file", help="UTF-8 text sent as a completion prompt "
                                                "(- for stdin).")]
ChatFile = Annotated[str | None, typer.Option("--chat", help="JSON list of {role, content} messages, rendered with "
                                              "the model's chat template (- for stdin).")]
TokensFile = Annotated[str | None, typer.Option("--tokens-file", help="JSON list of token ids; no tokenizer needed "
                                                "(- for stdin).")]
ModelOption = Annotated[str | None, typer.Option("--model", help="The value of vLLM's --model: names the keys (only "
                                                 "this model's chunks are taken), and a local directory also gives "
                                                 "the tokenizer.")]
ConfigOption = Annotated[Path | None, typer.Option("--config", help="A 'kvctl config init' directory or an "
                                                   "lmcache.yaml: alone, its stores are read directly (no engine); "
                                                   "with an MP server's --instance, its L2 stores.")]
VllmOption = Annotated[str | None, typer.Option("--vllm-url", help="A running vLLM's OpenAI server URL: it tokenizes "
                                                "prompts (instead of a local tokenizer) and takes prewarm's "
                                                "requests.")]
CoordinatorOption = Annotated[str | None, typer.Option("--coordinator", help="MP mode: the LMCache coordinator's URL, "
                                                       "where pins live (default: the server's own, or "
                                                       "'coordinator:' in kvctl.yaml).")]
KvDtype = Annotated[str | None, typer.Option("--kv-dtype", help="KV cache dtype (default: vLLM's rule for the "
                                             "model's config.json).")]
WorldSize = Annotated[int, typer.Option("--world-size", min=1, help="Tensor x pipeline parallel size of the "
                                        "deployment.")]
HashSeed = Annotated[str | None, typer.Option("--hash-seed", help="PYTHONHASHSEED of the serving process "
                                              "(default: from env.sh).")]


def tier_names(tiers: list[Tier] | None) -> tuple[str, ...] | None:
    return tuple(tier.value for tier in tiers) if tiers else None


# -- flag groups: declared once here, arriving in a command as one value --------------------------------------

SELECTOR_FLAGS = {  # Selector's field -> (how the flag is declared, its default)
    "instance": (FleetInstance, None), "state": (StateOption, None), "inventory": (InventoryOption, None),
    "config": (ConfigOption, None), "vllm_url": (VllmOption, None), "coordinator": (CoordinatorOption, None),
    "model": (ModelOption, None), "kv_dtype": (KvDtype, None), "world_size": (WorldSize, 1),
    "hash_seed": (HashSeed, None),
}
PROMPT_FLAGS = {"prompt_file": (PromptFile, None), "chat": (ChatFile, None), "tokens_file": (TokensFile, None)}


def _flag_group(target: str, build, declared: dict, names: tuple[str, ...], overrides: dict):
    """A decorator: the command's parameter `target` becomes the flags `names` (declared in `declared`, or
    as `overrides` says), and the command receives `build(**their values)` as `target`."""
    import functools
    import inspect
    import typing

    def wrap(command):
        hints = typing.get_type_hints(command, include_extras=True)
        own = [parameter.replace(annotation=hints.get(parameter.name, parameter.annotation))
               for parameter in inspect.signature(command).parameters.values() if parameter.name != target]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=declared[name][1],
                                   annotation=overrides.get(name, declared[name][0])) for name in names]

        @functools.wraps(command)
        def run(*args, **kwargs):
            return command(*args, **{target: build(**{name: kwargs.pop(name) for name in names})}, **kwargs)

        del run.__wrapped__  # Typer reads the flags of `run`, not of the command
        run.__signature__ = inspect.Signature(own + added)
        run.__annotations__ = {parameter.name: parameter.annotation for parameter in own + added}
        return run

    return wrap


def _selector(**given):
    from kvctl.core.instance.opening import Selector

    return Selector(**given)


def _prompt(**given):
    from kvctl.core.lmcache.tokens import PromptSource

    return PromptSource(**given)


def selector_flags(*names: str, **overrides):
    """The selector flags `names` (SELECTOR_FLAGS), arriving as `chosen: Selector`; `overrides` re-declares
    one (e.g. instance=InstanceOption for a command of one instance)."""
    return _flag_group("chosen", _selector, SELECTOR_FLAGS, names, overrides)


def prompt_flags(command):
    """--prompt-file, --chat and --tokens-file, arriving as `prompt: PromptSource`."""
    return _flag_group("prompt", _prompt, PROMPT_FLAGS, tuple(PROMPT_FLAGS), {})(command)
