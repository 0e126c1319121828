"""`kvctl model tiny`: the project's tiny offline model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvctl.output import Table

app = typer.Typer(help="Models kvctl builds for offline use.", no_args_is_help=True)


@app.command()
def tiny(
    ctx: typer.Context,
    directory: Annotated[Path | None, typer.Argument(help="Where to build it (default: kvctl's cache, "
                                                     "~/.cache/kvctl/models/tiny).", file_okay=False)] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when the directory holds a complete model.")] = False,
) -> None:
    """Build a tiny Llama with a BPE tokenizer trained on Python's standard library: offline, deterministic,
    small enough for vLLM's CPU backend."""
    from kvctl.core.common.paths import models_dir
    from kvctl.core.serve.tiny_model import MODEL_FILES, build_tiny_model, model_digest

    target = (directory or models_dir() / "tiny").expanduser().absolute()
    existed = target.exists() and all((target / name).exists() for name in MODEL_FILES)
    if not existed or force:
        ctx.obj.info(f"building the tiny model in {target} …")
    build_tiny_model(target, force=force)
    payload = {"path": str(target), "built": force or not existed, "sha256": model_digest(target),
               "files": sorted(path.name for path in target.iterdir())}
    ctx.obj.emit(payload, [Table(["field", "value"], [("path", payload["path"]), ("sha256", payload["sha256"]),
                                                       ("built now", str(payload["built"]).lower())])])
