"""`kvctl plugins enable|disable`: load kvctl's plugins into a deployment kvctl did not launch, by
changing its own vLLM --kv-transfer-config (a file, shown as a diff and confirmed before it is
written; or a command-line value, printed changed for the deployment's command line)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.manage_backends import confirm
from kvctl.core.errors import KvctlError, UsageError

app = typer.Typer(help="Load kvctl's plugins into a deployment kvctl did not launch (its vLLM "
                  "--kv-transfer-config).", no_args_is_help=True)

KvTransferOption = Annotated[str, typer.Option(
    "--kv-transfer-config", metavar="FILE|JSON",
    help="The deployment's kv-transfer-config: a JSON file (changed in place after a confirmation), or the JSON "
         "value its vLLM command line passes (printed changed, nothing written).")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Show the change; write nothing.")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Write the file without asking.")]


@app.command()
def enable(ctx: typer.Context, kv_transfer_config: KvTransferOption, dry_run: DryRunOption = False,
           yes: YesOption = False) -> None:
    """Make vLLM load kvctl's plugins: adds "kv_connector_module_path": "kvctl_plugins.vllm_connector".

    The connector keeps its name (LMCacheConnectorV1). The image needs the plugins installed
    (pip install ./plugins, no other dependency); restart vLLM for the change to take effect.
    """
    _change(ctx, kv_transfer_config, True, dry_run, yes)


@app.command()
def disable(ctx: typer.Context, kv_transfer_config: KvTransferOption, dry_run: DryRunOption = False,
            yes: YesOption = False) -> None:
    """Make vLLM load LMCache's connector alone again: removes kvctl's kv_connector_module_path."""
    _change(ctx, kv_transfer_config, False, dry_run, yes)


def _change(ctx: typer.Context, given: str, enable: bool, dry_run: bool, yes: bool) -> None:
    from kvctl.core.common.safe_files import read_text
    from kvctl.core.config.plugins import plan_change
    from kvctl.core.lmcache.config import parse_kv_transfer_config

    out = ctx.obj
    inline = given.lstrip().startswith("{")
    path = None if inline else Path(given).expanduser()
    text = given if inline else read_text(path)
    change = plan_change(parse_kv_transfer_config(text, "the value" if inline else str(path)),
                         None if inline else str(path), enable)
    if change.diff():
        print(change.diff(), end="", file=sys.stderr)
    if not change.changed:
        out.info(f"{'already loads' if enable else 'does not load'} kvctl's plugins: nothing to change")
    elif path is not None and not dry_run:
        confirm(f"write {path}?", f"refusing to change {path}", "add --yes, or --dry-run to see the change", yes)
        _rewrite(path, text, change.after)
    out.emit(change.as_dict(), [change.as_dict()["kv_transfer_config"]])


def _rewrite(path: Path, before: str, after: dict) -> None:
    """Write the file whole (beside it, then renamed) with its own mode, unless it changed meanwhile."""
    import json
    import os
    import tempfile

    from kvctl.core.common.safe_files import read_text

    if read_text(path) != before:
        raise UsageError(f"{path} changed while kvctl was reading it", hint="run the command again")
    mode = os.stat(path).st_mode & 0o777
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(after, indent=2) + "\n")
        os.chmod(temp, mode)
        os.replace(temp, path)
    except OSError as error:
        Path(temp).unlink(missing_ok=True)
        raise KvctlError(f"cannot write {path}: {error.strerror}", hint="check the directory's permissions") from None
