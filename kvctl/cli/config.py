"""`kvctl config init | validate | show`."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.options import HashAlgorithm, Mode
from kvctl.core.errors import ExitCode
from kvctl.output import Table, escape

app = typer.Typer(help="Generate, validate and show LMCache + vLLM configuration.", no_args_is_help=True)


@app.command()
def init(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write lmcache.yaml, kv-transfer-config.json "
                                      "and env.sh into.", file_okay=False)] = Path("kvctl-config"),
    mode: Annotated[Mode, typer.Option(help="inprocess (LMCacheConnectorV1) or mp (LMCacheMPConnector + "
                                       "lmcache server).")] = Mode.inprocess,
    tier: Annotated[list[str] | None, typer.Option(
        help="A cache tier: cpu[:GB], disk:PATH[:GB], or a redis://, rediss://, redis-sentinel://, redis-cluster:// "
             "URL. Repeatable. Default: cpu and disk sized from this machine.")] = None,
    chunk_size: Annotated[int, typer.Option(help="Tokens per chunk; a multiple of vLLM's block size "
                                            "(128 on CPU).")] = 256,
    hash_algorithm: Annotated[HashAlgorithm | None, typer.Option(
        help="Chunk hash: sha256_cbor (in-process default), blake3 (MP default), builtin, sha256, xxhash, "
             "xxhash_cbor.")] = None,
    internal_api_port_start: Annotated[int, typer.Option(help="First port of LMCache's internal API servers "
                                                         "(scheduler; worker r is start + 1 + r).")] = 6999,
    internal_api_host: Annotated[str, typer.Option(help="Where LMCache's internal API servers bind. Beyond loopback, "
                                                   "kvctl's routes then require a bearer token, generated into "
                                                   "env.sh.")] = "127.0.0.1",
    mp_port: Annotated[int, typer.Option(help="MP mode: the lmcache server's request port.")] = 5555,
    mp_http_port: Annotated[int, typer.Option(help="MP mode: the lmcache server's HTTP port.")] = 8080,
    model: Annotated[str | None, typer.Option(help="Model kvctl commands use by default with this config.")] = None,
    instance_id: Annotated[str | None, typer.Option(help="lmcache_instance_id (default: from the directory "
                                                    "name).")] = None,
    plugins: Annotated[bool, typer.Option(help="In-process mode: load kvctl's plugins into vLLM (management "
                                          "routes, CPU connector, restart-proof disk tier).")] = True,
    controller: Annotated[str | None, typer.Option(
        help="In-process mode: register with LMCache's controller at HOST:PORT (its HTTP port; the ZMQ ports "
             "beside it as kvctl serve --controller starts them), heartbeats on.")] = None,
    force: Annotated[bool, typer.Option(help="Replace existing files.")] = False,
) -> None:
    """Write a working LMCache configuration that kvctl can manage."""
    from kvctl.core.config.init import ConfigRequest, build_config, write_files
    from kvctl.core.lmcache.config import redact
    from kvctl.core.lmcache.tiers import parse_tier

    request = ConfigRequest(
        mode=mode.value, tiers=[parse_tier(text) for text in tier or []], chunk_size=chunk_size,
        hash_algorithm=hash_algorithm.value if hash_algorithm else None,
        internal_api_port_start=internal_api_port_start, mp_port=mp_port, mp_http_port=mp_http_port,
        model=model, instance_id=instance_id, plugins=plugins, internal_api_host=internal_api_host,
        controller=controller,
    )
    generated = build_config(request, out)
    written = write_files(generated.render(out.expanduser().absolute()), out, force)
    out_ = ctx.obj
    for note in generated.notes:
        out_.warn(note)
    values = {key: redact(key, value) for key, value in generated.lmcache.items()}
    payload = {
        "out": str(out),
        "mode": generated.mode,
        "files": [str(path) for path in written],
        "lmcache": values,
        "kv_transfer_config": redact("kv_transfer_config", generated.kv_transfer),
        "notes": generated.notes,
    }
    rows = [(key, _text(value)) for key, value in values.items()]
    out_.emit(payload, [Table(["setting", "value"], rows, title=f"{generated.mode} configuration",
                              caption="written: " + ", ".join(path.name for path in written) + f" in {out}")])
    out_.success(f"wrote {len(written)} files to {out}; check them with 'kvctl config validate {out}'")


@app.command()
def validate(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="lmcache.yaml, kv-transfer-config.json, env.sh, or a directory "
                                         "from 'kvctl config init'.")],
    mode: Annotated[Mode | None, typer.Option(help="Check as this mode (default: detected).")] = None,
    block_size: Annotated[int | None, typer.Option(help="vLLM block size to check chunk sizes against "
                                                   "(default: 128 on CPU, 16 on GPU).")] = None,
    lmcache: Annotated[bool, typer.Option(help="Also load the file with LMCache's own config code "
                                          "(when lmcache is installed).")] = True,
) -> None:
    """Check a configuration; exit 1 on any error. LMCache's warnings and silent drops become errors."""
    from kvctl.core.common.display import PATH_CHARS, shown
    from kvctl.core.config.validate import validate as run_validation

    report = run_validation(file, mode=mode.value if mode else None, block_size=block_size, use_lmcache=lmcache)
    out = ctx.obj
    colors = {"error": "bold red", "warning": "yellow"}
    name = shown(str(file), PATH_CHARS)
    lines = [f"{escape(name)}: [{colors[finding.level]}]{finding.level}[/]: {escape(finding.message)}"
             + (f" [cyan](hint: {escape(finding.hint)})[/]" if finding.hint else "") for finding in report.findings]
    out.emit(report.as_dict(), lines)
    errors = sum(1 for finding in report.findings if finding.level == "error")
    warnings = len(report.findings) - errors
    checked = "" if report.lmcache_checked else " (LMCache's own loader not run)"
    if errors:
        out.error(f"{name}: {errors} error(s), {warnings} warning(s){checked}", hint="fix the errors listed above")
        raise typer.Exit(ExitCode.ERROR)
    out.success(f"{name}: valid, {warnings} warning(s){checked}")


@app.command()
def show(
    ctx: typer.Context,
    file: Annotated[Path | None, typer.Argument(help="lmcache.yaml or a 'kvctl config init' directory "
                                                "(default: $LMCACHE_CONFIG_FILE).")] = None,
    sources: Annotated[bool, typer.Option("--sources", help="Show where each value came from.")] = False,
    changed: Annotated[bool, typer.Option("--changed", help="Only values that differ from LMCache's "
                                          "defaults.")] = False,
) -> None:
    """Show the effective LMCache settings: defaults < file < LMCACHE_* environment < vLLM extra config."""
    from kvctl.core.config.show import effective_settings

    target = file or (Path(os.environ["LMCACHE_CONFIG_FILE"]) if os.environ.get("LMCACHE_CONFIG_FILE") else None)
    settings = effective_settings(target, dict(os.environ))
    out = ctx.obj
    for problem in settings.problems:
        out.warn(problem)
    names = [key for key in settings.values if not changed or settings.sources[key] != "default"]
    columns = ["key", "value", "source"] if sources else ["key", "value"]
    rows = [(key, _text(settings.values[key]), settings.sources[key])[: len(columns)] for key in names]
    payload = {
        "file": str(target) if target else None,
        "mode": settings.mode,
        "values": {key: settings.values[key] for key in names},
        "sources": {key: settings.sources[key] for key in names},
    }
    if settings.command:
        payload["command"] = settings.command
    caption = ("lmcache server " + shlex.join(settings.command)) if settings.command else None
    out.emit(payload, [Table(columns, rows, title=f"{settings.mode} settings", caption=caption)])


def _text(value: object) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)
