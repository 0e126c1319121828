"""`kvctl keys` and `kvctl lookup`: a prompt's chunk keys, and which tiers hold them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.options import InventoryOption, TimeoutOption
from kvctl.core.errors import ExitCode, UsageError
from kvctl.output import Table, escape

PromptFile = Annotated[str | None, typer.Option("--prompt-file", help="UTF-8 text sent as a completion prompt "
                                                "(- for stdin).")]
ChatFile = Annotated[str | None, typer.Option("--chat", help="JSON list of {role, content} messages, rendered with "
                                              "the model's chat template (- for stdin).")]
TokensFile = Annotated[str | None, typer.Option("--tokens-file", help="JSON list of token ids; no tokenizer needed "
                                                "(- for stdin).")]
ModelOption = Annotated[str | None, typer.Option("--model", help="The value of vLLM's --model: names the keys, and "
                                                 "a local directory also gives the tokenizer.")]
ConfigOption = Annotated[Path | None, typer.Option("--config", help="A 'kvctl config init' directory or an "
                                                   "lmcache.yaml.")]
KvDtype = Annotated[str | None, typer.Option("--kv-dtype", help="KV cache dtype (default: vLLM's rule for the "
                                             "model's config.json).")]
WorldSize = Annotated[int, typer.Option("--world-size", min=1, help="Tensor x pipeline parallel size of the "
                                        "deployment.")]
HashSeed = Annotated[str | None, typer.Option("--hash-seed", help="PYTHONHASHSEED of the serving process "
                                              "(default: from env.sh).")]


VllmOption = Annotated[str | None, typer.Option("--vllm-url", help="Tokenize with a running vLLM "
                                                "(its OpenAI server URL) instead of a local tokenizer.")]


def load_tokens(prompt_file: str | None, chat: str | None, tokens_file: str | None, model_dir: str | None,
                vllm_url: str | None = None, model: str | None = None) -> list[int]:
    from kvctl.core import tokens

    given = [name for name, value in (("--prompt-file", prompt_file), ("--chat", chat),
                                      ("--tokens-file", tokens_file)) if value]
    if len(given) != 1:
        raise UsageError("give exactly one of --prompt-file, --chat, --tokens-file",
                         hint="e.g. kvctl lookup --prompt-file prompt.txt --config DIR --model MODEL")
    if tokens_file:
        return tokens.read_token_ids(tokens_file)
    if vllm_url:
        from kvctl.clients.vllm import VLLMClient

        with VLLMClient(vllm_url) as vllm:
            name = model or vllm.models()[0]
            if chat:
                return vllm.tokenize(name, messages=tokens.read_chat(chat))
            return vllm.tokenize(name, prompt=tokens.read_text(prompt_file))
    if model_dir is None:
        raise UsageError("tokenizing a prompt needs the model's tokenizer",
                         hint="pass --model with a local model directory, or --tokens-file")
    tokenizer = tokens.LocalTokenizer(model_dir)
    return (tokenizer.encode_chat(tokens.read_chat(chat)) if chat
            else tokenizer.encode_prompt(tokens.read_text(prompt_file)))


def resolve(config: Path | None, model: str | None, kv_dtype: str | None, world_size: int, hash_seed: str | None):
    from kvctl.core.target import target_from_config

    if config is None:
        raise UsageError("which deployment? kvctl needs its LMCache configuration",
                         hint="pass --config with a 'kvctl config init' directory or an lmcache.yaml")
    return target_from_config(config, model, kv_dtype, world_size, hash_seed)


def keys(
    ctx: typer.Context,
    prompt_file: PromptFile = None, chat: ChatFile = None, tokens_file: TokensFile = None,
    model: ModelOption = None, config: ConfigOption = None, kv_dtype: KvDtype = None,
    world_size: WorldSize = 1, hash_seed: HashSeed = None, vllm_url: VllmOption = None,
) -> None:
    """Print the chunk keys LMCache makes for a prompt (per rank in tensor-parallel deployments)."""
    from kvctl.core.keys import MPKeyRecipe, chunk_bounds, chunk_hashes, key_string, mp_object_keys

    target = resolve(config, model, kv_dtype, world_size, hash_seed)
    token_ids = load_tokens(prompt_file, chat, tokens_file, target.model_dir, vllm_url, target.recipe.model_name)
    recipe = target.recipe
    bounds = chunk_bounds(len(token_ids), recipe.chunk_size, getattr(recipe, "save_unfull_chunk", False))
    if isinstance(recipe, MPKeyRecipe):
        per_chunk = [[key.native_key() for key in ranks] for ranks in mp_object_keys(token_ids, recipe)]
    else:
        hashes = chunk_hashes(token_ids, recipe)
        per_chunk = [[key_string(recipe.for_worker(worker), h) for worker in range(recipe.world_size)] for h in hashes]
    chunks = [{"index": i, "start": start, "end": end, "keys": ranks}
              for i, ((start, end), ranks) in enumerate(zip(bounds, per_chunk))]
    rows = [(c["index"], f"{c['start']}-{c['end']}", "\n".join(c["keys"])) for c in chunks]
    ctx.obj.emit({"model": recipe.model_name, "mode": target.mode, "chunk_size": recipe.chunk_size,
                  "prompt_tokens": len(token_ids), "chunks": chunks},
                 [Table(["chunk", "tokens", "key"], rows, title=f"{len(chunks)} chunks of {len(token_ids)} tokens")])


def lookup(
    ctx: typer.Context,
    prompt_file: PromptFile = None, chat: ChatFile = None, tokens_file: TokensFile = None,
    model: ModelOption = None, config: ConfigOption = None, kv_dtype: KvDtype = None,
    world_size: WorldSize = 1, hash_seed: HashSeed = None, vllm_url: VllmOption = None,
    instance: Annotated[str | None, typer.Option("--instance", help="A running engine: a 'kvctl serve --name' or "
                                                 "inventory name, 'all' (every inventory instance), or the internal "
                                                 "API URL of worker 0 (http://127.0.0.1:7000, "
                                                 "unix:/path_7000).")] = None,
    offline: Annotated[bool, typer.Option("--offline", help="Read the disk and Redis tiers directly, no server "
                                          "(needs --config).")] = False,
    state: Annotated[Path | None, typer.Option("--state", help="The state file of a 'kvctl serve' (default: the "
                                               "most recent one); used when neither --instance nor --config is "
                                               "given.")] = None,
    inventory: InventoryOption = None, timeout: TimeoutOption = 60.0,
) -> None:
    """Which chunks of a prompt are cached, on which tier, how many tokens vLLM would get, and why not.

    Side-effect free: never pins a chunk, never changes eviction order, never reads a value.
    """
    out = ctx.obj
    if instance == "all":
        _lookup_fleet(out, state, inventory, timeout, prompt_file, chat, tokens_file, model, vllm_url)
        return
    if config is None:
        instance, config, vllm_url = instance_target(instance, state, vllm_url)
    if instance and not offline and config is None:
        result = live_lookup(instance, prompt_file, chat, tokens_file, model, vllm_url)
    else:
        if offline and config is None:
            raise UsageError("--offline reads the tiers named in a configuration", hint="pass --config DIR")
        result = store_lookup(out, prompt_file, chat, tokens_file, model, config, kv_dtype, world_size, hash_seed,
                              vllm_url, None if offline else instance)
    out.emit(result.as_dict(), render_lookup(result))
    for tier, message in result.errors.items():
        out.error(f"{tier} tier: {message}")
    if result.errors:
        raise typer.Exit(ExitCode.PARTIAL if result.tiers_checked else ExitCode.UNREACHABLE)


def _lookup_fleet(out, state, inventory, timeout, prompt_file, chat, tokens_file, model, vllm_url) -> None:
    """The prompt looked up on every inventory instance at once: which of them would hit, and how far."""
    from kvctl.cli.observe import report_errors
    from kvctl.core import instances as fleet

    def lookup_one(found):
        url, config, found_vllm = target_of(found, vllm_url)
        if config is None:
            return live_lookup(url, prompt_file, chat, tokens_file, model, found_vllm)
        return store_lookup(out, prompt_file, chat, tokens_file, model, config, None, 1, None, found_vllm, url)

    outcomes = fleet.fan_out(fleet.resolve("all", state, inventory), lookup_one, timeout)
    reports, code = fleet.fleet_reports(outcomes, lambda result: result.as_dict())
    out.emit({"instances": reports}, [item for outcome in outcomes if outcome.error is None
                                      for item in [f"[bold]{escape(outcome.instance)}[/]",
                                                   *render_lookup(outcome.result)]])
    report_errors(out, reports)
    raise typer.Exit(code)


def instance_target(instance: str | None, state: Path | None,
                    vllm_url: str | None) -> tuple[str | None, Path | None, str | None]:
    """(server URL, config dir, vLLM URL) for --instance URL or NAME (inventory or kvctl serve), or a state file.

    In-process: worker 0's internal API and no config (the engine knows its own tiers). MP: the
    lmcache server's HTTP URL (its L1) and the config dir (the L2 stores kvctl reads directly).
    """
    from kvctl.core.instances import resolve

    if instance == "all":
        raise UsageError("this command addresses one instance, not --instance all",
                         hint="name one with --instance NAME (lookup, ls, pin, unpin, pins, evict, health, stats "
                         "and top take --instance all)")
    return target_of(resolve(instance, state)[0], vllm_url)


def target_of(found, vllm_url: str | None) -> tuple[str | None, Path | None, str | None]:
    """(server URL, config dir, vLLM URL) of a resolved instance."""
    vllm_url = vllm_url or found.vllm
    if found.mode == "inprocess":
        return found.worker, None, vllm_url
    return found.mp_http, Path(found.config_dir) if found.config_dir else None, vllm_url


def store_lookup(out, prompt_file, chat, tokens_file, model, config, kv_dtype, world_size, hash_seed, vllm_url,
                 instance: str | None = None):
    """The tiers a configuration names, read directly; in MP mode with the server's URL, its L1 too
    (an in-process instance answers for every tier itself)."""
    from kvctl.core.target import MP_L1_UNCHECKED

    target = resolve(config, model, kv_dtype, world_size, hash_seed)
    if instance and target.mode != "mp":
        return live_lookup(instance, prompt_file, chat, tokens_file, model, vllm_url)
    token_ids = load_tokens(prompt_file, chat, tokens_file, target.model_dir, vllm_url, target.recipe.model_name)
    for note in target.notes:
        if not (instance and note == MP_L1_UNCHECKED):
            out.info(f"note: {note}")
    from kvctl.core.lookup import read_tiers

    return read_tiers(token_ids, target, instance)


def live_lookup(instance: str, prompt_file, chat, tokens_file, model, vllm_url):
    """Look a prompt up through a running in-process engine (every worker; its Redis checked)."""
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.core.lookup import engine_lookup

    with InternalAPIClient(instance) as worker:
        info = worker.info()
    if info.get("engine") == "mp":
        raise UsageError(f"{instance} is an LMCache MP server: its lookup joins the L2 tiers of its configuration",
                         hint="pass --config with the server's configuration directory too")
    model_dir = model or (info["model"] if Path(info["model"]).is_dir() else None)
    token_ids = load_tokens(prompt_file, chat, tokens_file, model_dir, vllm_url, info["model"])
    return engine_lookup(instance, info, token_ids)


def render_lookup(result) -> list:
    marks = {tier: tier[0].upper() for tier in ("cpu", "disk", "redis")}
    rows = []
    for chunk in result.chunks:
        tiers = " ".join(marks[tier] if tier in chunk.tiers else "·" for tier in result.tiers_checked)
        rows.append((chunk.index, f"{chunk.start}-{chunk.end}", tiers or "-", chunk.key))
    hits = result.hit_tokens
    summary = (f"hit tokens: {hits['total']} of {result.prompt_tokens} "
               f"(cpu {hits['cpu']}, disk {hits['disk']}, redis {hits['redis']}); tiers checked: "
               f"{', '.join(result.tiers_checked) or 'none'}")
    items: list = [Table(["chunk", "tokens", " ".join(marks[t] for t in result.tiers_checked) or "tiers", "key"], rows,
                         title=f"{result.model} ({result.mode}, chunk {result.chunk_size})", caption=summary)]
    for diagnostic in result.diagnostics:
        line = f"[yellow]{diagnostic.cause}[/]: {escape(diagnostic.message)}"
        if diagnostic.hint:
            line += f" [cyan](hint: {escape(diagnostic.hint)})[/]"
        items.append(line)
    return items


