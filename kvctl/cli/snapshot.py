"""`kvctl snapshot save|load|ls`: move a warm cache between nodes as one file (kvctl.core.cache.snapshot)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.fleet import open_one, selector
from kvctl.cli.options import (
    InstanceOption,
    ModelOption,
    Tier,
    selector_flags,
)
from kvctl.core.errors import ExitCode, UsageError
from kvctl.output import Table

app = typer.Typer(help="Snapshots: save cached chunks to one file, load them into another instance or "
                  "configuration.", no_args_is_help=True)

PromptFiles = Annotated[list[str] | None, typer.Option("--prompt-file", help="A prompt's text file (repeatable).")]
ChatFiles = Annotated[list[str] | None, typer.Option("--chat", help="A JSON chat file (repeatable).")]
TokensFiles = Annotated[list[str] | None, typer.Option("--tokens-file", help="A JSON token-ids file (repeatable).")]
PinSetFile = Annotated[Path | None, typer.Option("--pin-set", help="Every prompt of a pin set file.")]
SnapshotFile = Annotated[Path, typer.Argument(help="A .kvsnap file written by kvctl snapshot save.", dir_okay=False)]


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


@app.command()
@selector_flags("model", "vllm_url", "instance", "state", "config", "kv_dtype", "world_size", "hash_seed",
                instance=InstanceOption)
def save(
    ctx: typer.Context, chosen,
    out: Annotated[Path, typer.Option("--out", "-o", help="The snapshot file to write (e.g. warm.kvsnap).",
                                      dir_okay=False)],
    prompt_file: PromptFiles = None, chat: ChatFiles = None, tokens_file: TokensFiles = None,
    pin_set: PinSetFile = None,
    tier: Annotated[Tier | None, typer.Option("--tier", help="With --all: the tier whose chunks to save.")] = None,
    everything: Annotated[bool, typer.Option("--all", help="Every chunk of --tier of the served model (or --model), "
                                             "at its world size and KV dtype.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace the output file if it exists.")] = False,
) -> None:
    """Save prompts' cached chunks (or a whole tier's) with a manifest into one file.

    The file is a tar of LMCache's chunk bytes and manifest.json: what made the keys (model, KV dtype,
    world size, chunk size, hash algorithm, hash seed), versions, each chunk's BLAKE3 checksum, and each saved
    prompt's token ids. Chunks no tier holds are reported (exit 6); nothing cached at all is an error.
    """
    from kvctl.core.cache import snapshot

    sources = _prompt_sources(prompt_file, chat, tokens_file, pin_set)
    if everything != (tier is not None) or not (sources or everything):
        raise UsageError("say what to save: --prompt-file/--chat/--tokens-file, --pin-set, or --tier T --all",
                         hint="e.g. kvctl snapshot save --prompt-file system.txt -o warm.kvsnap")
    found, model = open_one(chosen), chosen.model
    prompts = snapshot.select_prompts(found, sources, model)
    keys = snapshot.tier_keys(found, tier.value, model) if everything else []
    report = snapshot.save(found, out, prompts, keys, model, overwrite=force)
    rows = [(p.source, len(p.tokens), f"{p.saved}/{len(p.keys)}") for p in report.manifest.prompts]
    ctx.obj.emit(report.as_dict(), [Table(["prompt", "tokens", "saved chunks"], rows,
                                          caption=f"{len(report.manifest.chunks)} chunks, "
                                          f"{_mib(report.manifest.total_bytes)} -> {report.path}")])
    if report.exit_code:
        ctx.obj.error(f"{len(report.manifest.missing)} selected chunks are not cached on {found.name} and are not "
                      "in the snapshot", hint="prewarm them first (kvctl prewarm), then save again")
        raise typer.Exit(report.exit_code)


@app.command()
@selector_flags("model", "vllm_url", "instance", "state", "config", "kv_dtype", "world_size", "hash_seed",
                instance=InstanceOption)
def load(
    ctx: typer.Context, chosen,
    file: SnapshotFile,
    tier: Annotated[Tier | None, typer.Option("--tier", help="Where the chunks go (default: a running engine's CPU "
                                              "tier; a configuration's disk tier).")] = None,
) -> None:
    """Load a snapshot: refuse a target that would make other keys, verify every checksum, then write.

    Through a running engine (--instance) the chunks go into its tiers, so its index and accounting
    stay exact (an MP server: into its L1, which its store policy copies on to L2); into a
    configuration (--config, no engine running) they are written to its disk directory or Redis
    directly. Nothing is written unless every check passes. Per saved prompt: the
    chunks now cached and the tokens a request would be served from the cache.
    """
    from kvctl.core.cache import snapshot

    if tier is Tier.all:
        raise UsageError("--tier all does not say where to write", hint="choose one of cpu, disk, redis")
    found, model = open_one(chosen), chosen.model
    report = snapshot.load(file, found, tier.value if tier else None, model)
    rows = [(p.source, p.tokens, f"{p.cached}/{p.chunks}", p.hit_tokens) for p in report.prompts]
    written = ", ".join(f"{count} written to {name}" for name, count in report.written.items())
    already, dropped = sum(report.already.values()), sum(report.dropped.values())
    ctx.obj.emit(report.as_dict(), [Table(["prompt", "tokens", "cached chunks", "hit tokens"], rows,
                                          caption=f"{report.chunks} chunks ({_mib(report.bytes)}) verified; "
                                          f"{written}; {already} already there")])
    if dropped or any(p.cached < p.chunks for p in report.prompts):
        ctx.obj.error(f"not everything stayed: {dropped} chunks were not kept by the tier, and saved prompts are "
                      "not all wholly cached", hint="the tier may be too small for the snapshot: see kvctl stats")
        raise typer.Exit(ExitCode.PARTIAL)


@app.command("copy")
def copy_live(
    ctx: typer.Context,
    source: Annotated[str, typer.Option("--from", help="The instance that holds the prompts' chunks (a name, a "
                                        "kvctl serve name, or a URL).")],
    target: Annotated[str, typer.Option("--to", help="The instance to copy them into.")],
    prompt_file: PromptFiles = None, chat: ChatFiles = None, tokens_file: TokensFiles = None,
    pin_set: PinSetFile = None,
    tier: Annotated[Tier | None, typer.Option("--tier", help="Where the chunks go on the target (default: its "
                                              "CPU tier).")] = None,
    model: ModelOption = None,
) -> None:
    """Copy prompts' cached chunks from one live instance to another, verified.

    Read from the source, checksummed, written through the target (refused where it makes other
    keys), then read back from the target and compared chunk by chunk. This is the verified way to
    move a warm prompt between nodes: LMCache's controller /move reports success on CPU machines while
    leaving all-zero chunks. Exit 6 when a chunk is missing, dropped or comes back different.
    """
    from kvctl.core.cache import snapshot

    if tier is Tier.all:
        raise UsageError("--tier all does not say where to write", hint="choose one of cpu, disk, redis")
    sources = _prompt_sources(prompt_file, chat, tokens_file, pin_set)
    if not sources:
        raise UsageError("say what to copy: --prompt-file/--chat/--tokens-file or --pin-set",
                         hint="e.g. kvctl snapshot copy --from node-a --to node-b --prompt-file system.txt")
    origin, destination = open_one(selector(source, model=model)), open_one(selector(target, model=model))
    report = snapshot.copy(origin, destination, snapshot.select_prompts(origin, sources, model), model,
                           tier.value if tier else None)
    rows = [(p.source, p.tokens, f"{p.cached}/{p.chunks}", p.hit_tokens) for p in report.loaded.prompts]
    verified = report.as_dict()["verified"]
    ctx.obj.emit(report.as_dict(), [Table(["prompt", "tokens", "cached chunks", "hit tokens"], rows,
                                          caption=f"{report.source} -> {report.loaded.instance}: {verified} of "
                                          f"{report.loaded.chunks} chunks verified on the target")])
    if report.exit_code:
        ctx.obj.error(f"not a whole copy: {len(report.saved.manifest.missing)} chunks missing on the source, "
                      f"{sum(report.loaded.dropped.values())} dropped by the target, {len(report.mismatched)} "
                      "differing", hint="prewarm the source first, and check the target's room (kvctl stats)")
        raise typer.Exit(report.exit_code)


def _prompt_sources(prompt_file, chat, tokens_file, pin_set) -> list:
    """(label, PromptSource) for each prompt given, a pin set's entries included."""
    from kvctl.core.lmcache.tokens import PromptSource

    sources = ([(path, PromptSource(prompt_file=path)) for path in prompt_file or []]
               + [(path, PromptSource(chat=path)) for path in chat or []]
               + [(path, PromptSource(tokens_file=path)) for path in tokens_file or []])
    if pin_set is not None:
        from kvctl.core.pins import pinsets

        sources += [(entry.label, entry.source()) for entry in pinsets.load(pin_set).entries]
    return sources


@app.command("ls")
def list_snapshot(ctx: typer.Context, file: SnapshotFile) -> None:
    """What a snapshot holds: what made its keys, versions, its prompts and chunks."""
    from kvctl.core.cache import snapshot

    summary = snapshot.listing(file)
    facts = [(name, summary["keys"][name]) for name in snapshot.KEY_FIELDS]
    facts += [(f"{name} version", value) for name, value in summary["versions"].items()]
    facts += [("source", f"{summary['source'].get('instance')} ({summary['source'].get('kind')})"),
              (snapshot.KEY_FORMAT, summary["source"].get(snapshot.KEY_FORMAT, "chunk")),
              ("chunks", f"{summary['chunks']} ({_mib(summary['bytes'])})"), ("missing when saved", summary["missing"])]
    rows = [(p["source"], p["tokens"], f"{p['saved']}/{p['chunks']}") for p in summary["prompts"]]
    ctx.obj.emit(summary, [Table(["field", "value"], facts, title=str(file)),
                           Table(["prompt", "tokens", "saved chunks"], rows)])
