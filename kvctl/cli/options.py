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
VllmOption = Annotated[str | None, typer.Option("--vllm-url", help="Tokenize with a running vLLM (its OpenAI server "
                                                "URL) instead of a local tokenizer.")]
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
