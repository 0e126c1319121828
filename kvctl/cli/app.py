"""The root of the `kvctl` command: global options, command groups, error handling, exit codes."""

from __future__ import annotations

import os
import traceback
from typing import Annotated

import typer

from kvctl.cli import (
    cache,
    completion,
    config,
    doctor,
    evict,
    lookup,
    manage,
    manage_backends,
    model,
    observe,
    pinsets,
    prewarm,
    serve,
    version,
)
from kvctl.cli.options import OutputFormat
from kvctl.core.errors import EXIT_CODE_MEANINGS, ExitCode, KvctlError
from kvctl.output import Output

EPILOG = "Exit codes: " + ", ".join(f"{int(code)} {meaning}" for code, meaning in EXIT_CODE_MEANINGS.items()) + "."

app = typer.Typer(
    name="kvctl",
    help="Operate the KV cache of vLLM + LMCache: configure, serve, prewarm, and see which chunks are cached where.",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode="rich",
)
app.add_typer(config.app, name="config")
app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve.serve)
app.command("prewarm")(prewarm.prewarm)
app.command("lookup")(lookup.lookup)
app.command("keys")(lookup.keys)
app.command("ls")(cache.ls)
app.command("pin")(cache.pin)
app.command("unpin")(cache.unpin)
app.command("pins")(cache.pins)
app.add_typer(pinsets.app, name="pin-set")
app.command("evict")(evict.evict)
app.command("health")(observe.health)
app.command("stats")(observe.stats)
app.command("top")(observe.top)
app.command("freeze")(manage.freeze)
app.command("hot-cache")(manage.hot_cache)
app.add_typer(manage_backends.app, name="backends")
app.add_typer(manage.conf_app, name="conf")
app.command("chunk-stats")(manage.chunk_stats)
app.add_typer(manage_backends.quota_app, name="quota")
app.command("doctor")(doctor.doctor)
app.command("version")(version.version)
app.add_typer(model.app, name="model")
app.add_typer(completion.app, name="completion")
app.command("complete-values", hidden=True)(completion.complete_values)

# Options that belong to the root but that users type anywhere ("kvctl config validate x --format json").
GLOBAL_FLAGS = ("--debug", "-q", "--quiet")
GLOBAL_VALUED = ("--format",)


@app.callback()
def root(
    ctx: typer.Context,
    output_format: Annotated[
        OutputFormat | None,
        typer.Option("--format", help="Output format: table (default on a terminal) or json (default when piped).",
                     case_sensitive=False),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors (also KVCTL_DEBUG=1).")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Only data on stdout and errors on stderr.")] = False,
    show_completion: Annotated[
        bool, typer.Option("--show-completion", help="Print the completion script for your shell.", is_eager=True,
                           callback=completion.show_completion_callback, expose_value=False),
    ] = False,
    install_completion: Annotated[
        bool, typer.Option("--install-completion", help="Install completion for your shell.", is_eager=True,
                           callback=completion.install_completion_callback, expose_value=False),
    ] = False,
) -> None:
    ctx.obj = Output(output_format.value if output_format else None, quiet=quiet)
    from kvctl.core import instances

    instances.announce_inventory = lambda path: ctx.obj.info(f"using the inventory {path}")


def hoist_global_options(argv: list[str]) -> list[str]:
    """Move global options typed after a sub-command to the front, where Typer expects them."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg in GLOBAL_FLAGS:
            front.append(arg)
        elif arg in GLOBAL_VALUED and i + 1 < len(argv):
            front.extend(argv[i : i + 2])
            i += 1
        elif arg.split("=", 1)[0] in GLOBAL_VALUED:
            front.append(arg)
        else:
            rest.append(arg)
        i += 1
    return front + rest


def run(argv: list[str]) -> int:
    """Run kvctl with `argv` and return the exit code; errors are rendered, never raised."""
    debug = "--debug" in argv or os.environ.get("KVCTL_DEBUG", "") not in ("", "0")
    errors = Output(quiet=False)
    try:
        command = typer.main.get_command(app)
        result = command.main(args=hoist_global_options(argv), prog_name="kvctl", standalone_mode=False)
        return int(result) if isinstance(result, int) else ExitCode.OK
    except KvctlError as error:
        if debug:
            traceback.print_exc()
        errors.error(error.message, error.hint)
        return error.exit_code
    except typer.Exit as done:
        return done.exit_code
    except (typer.Abort, KeyboardInterrupt):  # Typer turns Ctrl-C (or EOF) at a prompt into Abort
        errors.error("interrupted")
        return ExitCode.INTERRUPTED
    except Exception as error:  # noqa: BLE001 - the last line of defence: one line, no traceback
        if _is_click_exception(error):
            context = getattr(error, "ctx", None)
            path = context.command_path if context is not None else "kvctl"
            errors.error(error.format_message(), hint=f"see '{path} --help'")
            return error.exit_code
        if debug:
            traceback.print_exc()
        errors.error(f"unexpected {type(error).__name__}: {error}",
                     hint="rerun with --debug for the traceback, and report it if it is a kvctl bug")
        return ExitCode.ERROR


def _is_click_exception(error: Exception) -> bool:
    """Click's exceptions (vendored by Typer) carry their own message and exit code."""
    return hasattr(error, "format_message") and isinstance(getattr(error, "exit_code", None), int)


