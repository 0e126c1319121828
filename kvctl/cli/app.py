"""The root of the `kvctl` command: global options, command groups, error handling, exit codes."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated

import typer
from typer.core import TyperGroup

from kvctl.cli import completion
from kvctl.cli.options import OutputFormat
from kvctl.core.common.display import cut_long_words
from kvctl.core.errors import EXIT_CODE_MEANINGS, ExitCode, KvctlError
from kvctl.output import Output

EPILOG = "Exit codes: " + ", ".join(f"{int(code)} {meaning}" for code, meaning in EXIT_CODE_MEANINGS.items()) + "."

# Every command, in the order `kvctl --help` lists them: (name, module, attribute, is a group, its summary).
# A command's module is imported only when that command runs; the root help lists the summaries (a test
# checks that they are the commands' own), so `kvctl --help` imports no command module.
COMMANDS: list[tuple[str, str, str, bool, str]] = [
    ("config", "config", "app", True, "Generate, validate and show LMCache + vLLM configuration."),
    ("serve", "serve", "serve", False, "Launch vLLM with LMCache, wait until every part is ready, print the "
     "endpoints, and supervise."),
    ("prewarm", "prewarm", "prewarm", False, "Send prompts to vLLM as prefill-only requests (max_tokens 1), then "
     "report what is cached, per prompt."),
    ("lookup", "lookup", "lookup", False, "Which chunks of a prompt are cached, on which tier, how many tokens vLLM "
     "would get, and why not."),
    ("keys", "lookup", "keys", False, "Print the chunk keys LMCache makes for a prompt (per rank in tensor-parallel "
     "deployments)."),
    ("ls", "cache", "ls", False, "List cached chunks per tier: key, size, pin state, age where known; totals per "
     "tier."),
    ("pin", "cache", "pin_app", True, "Pin a prompt's chunks: eviction skips them until unpinned (or the TTL ends)."),
    ("unpin", "cache", "unpin", False, "Release pins: one by id, every pin holding a prompt's chunks, or all (MP: "
     "one pin of a prompt)."),
    ("pins", "cache", "pins", False, "List the pins: kvctl's on an in-process instance; the coordinator's pinned "
     "keys in MP mode."),
    ("snapshot", "snapshot", "app", True, "Snapshots: save cached chunks to one file, load them into another "
     "instance or configuration."),
    ("evict", "evict", "evict", False, "Remove chunks from the CPU, disk and Redis tiers: a prompt's, given keys, or "
     "a whole tier."),
    ("health", "observe", "health", False, "Check every component (vLLM, LMCache APIs, offload socket, MP server, "
     "coordinator, Redis, disk) and its latency."),
    ("stats", "observe", "stats", False, "Hit rates, usage vs capacity per tier, evictions and pins: LMCache's "
     "counters live, the rest from /metrics."),
    ("top", "observe", "top", False, "A live view of health and stats that redraws in place (Ctrl-C to leave); "
     "--once exits like health."),
    ("freeze", "manage", "freeze", False, "Freeze an in-process engine: store no new chunks, keep serving what is "
     "cached (from the CPU tier)."),
    ("hot-cache", "manage", "hot_cache", False, "The CPU tier's hot cache of an in-process engine: on, off (which "
     "also empties it) or status."),
    ("backends", "manage_backends", "app", True, "An in-process engine's storage backends (tiers) at runtime, on "
     "every worker."),
    ("conf", "manage", "conf_app", True, "LMCache's settings on a running in-process engine (GET/POST /conf)."),
    ("chunk-stats", "manage", "chunk_stats", False, "LMCache's chunk statistics (how often prompts' chunks recur), "
     "kept by vLLM's scheduler process."),
    ("quota", "manage_backends", "quota_app", True, "An MP server's soft per-cache_salt quotas (its L2 IsolatedLRU "
     "eviction)."),
    ("reconfigure", "mp_admin", "app", True, "An MP server's storage at runtime: add, remove and resize Device-DAX "
     "devices (L2 adapter, L1 arenas)."),
    ("checksums", "mp_admin", "checksums", False, "MD5 per chunk of the KV cache blocks a worker registered with an "
     "MP server holds."),
    ("plugins", "plugins", "app", True, "Load kvctl's plugins into a deployment kvctl did not launch (its vLLM "
     "--kv-transfer-config)."),
    ("doctor", "doctor", "doctor", False, "Why would this deployment miss? What splits keys, overrides files, "
     "wastes tiers or exposes routes."),
    ("version", "version", "version", False, "Show the versions of kvctl, LMCache, vLLM, torch and Python, and "
     "whether this is a CPU or GPU machine."),
    ("model", "model", "app", True, "Models kvctl builds for offline use."),
    ("completion", "completion", "app", True, "Shell completion scripts for bash, zsh and fish."),
]
SETTINGS = {"serve": {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True}}}


class InListedOrder(TyperGroup):
    """The commands in COMMANDS' order, in the help and in completion (Typer lists groups last)."""

    def list_commands(self, ctx) -> list[str]:
        order = {name: index for index, (name, *_) in enumerate(COMMANDS)}
        return sorted(super().list_commands(ctx), key=lambda name: order.get(name, len(order)))


def build_app(only: str | None = None, everything: bool = False) -> typer.Typer:
    """The root app with every command real (`everything`), or only `only` real and the others as
    summaries for the root help."""
    import importlib

    app = typer.Typer(
        name="kvctl",
        cls=InListedOrder,
        help="Operate the KV cache of vLLM + LMCache: configure, serve, prewarm, and see which chunks are cached "
        "where.",
        epilog=EPILOG,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
        rich_markup_mode="rich",
    )
    for name, module, attribute, group, summary in COMMANDS:
        if everything or name == only:
            target = getattr(importlib.import_module(f"kvctl.cli.{module}"), attribute)
            if group:
                app.add_typer(target, name=name)
            else:
                app.command(name, **SETTINGS.get(name, {}))(target)
        elif group:
            app.add_typer(typer.Typer(help=summary), name=name)
        else:
            app.command(name, help=summary)(_summary_only)
    if everything or only == "complete-values":
        app.command("complete-values", hidden=True)(completion.complete_values)
    app.callback()(root)
    return app


def _summary_only() -> None:
    """Stands in for a command in the root help; never runs (the command's own module does)."""


def command_tree():
    """The root command with every command real: what the completion scripts describe."""
    return typer.main.get_command(__getattr__("app"))


def _show_completion(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        print(completion.render(completion.detect_shell(), command_tree()), end="")
        raise typer.Exit()


def _install_completion(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        shell = completion.detect_shell()
        target = completion.install_script(shell, command_tree())
        print(f"installed {shell} completion in {target}; open a new shell to use it", file=sys.stderr)
        raise typer.Exit()


# Options that belong to the root but that users type anywhere ("kvctl config validate x --format json").
GLOBAL_FLAGS = ("--debug", "-q", "--quiet")
GLOBAL_VALUED = ("--format",)


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
                           callback=_show_completion, expose_value=False),
    ] = False,
    install_completion: Annotated[
        bool, typer.Option("--install-completion", help="Install completion for your shell.", is_eager=True,
                           callback=_install_completion, expose_value=False),
    ] = False,
) -> None:
    ctx.obj = Output(output_format.value if output_format else None, quiet=quiet)
    ctx.meta[completion.COMMAND_TREE] = command_tree
    from kvctl.core.instance import addresses

    addresses.announce_inventory = lambda path: ctx.obj.info(f"using the inventory {path}")


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
        command = typer.main.get_command(build_app(command_name(argv)))
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
            errors.error(cut_long_words(error.format_message()), hint=f"see '{path} --help'")
            return error.exit_code
        if debug:
            traceback.print_exc()
        errors.error(f"unexpected {type(error).__name__}: {error}",
                     hint="rerun with --debug for the traceback, and report it if it is a kvctl bug")
        return ExitCode.ERROR


def _is_click_exception(error: Exception) -> bool:
    """Click's exceptions (vendored by Typer) carry their own message and exit code."""
    return hasattr(error, "format_message") and isinstance(getattr(error, "exit_code", None), int)




def command_name(argv: list[str]) -> str | None:
    """The command argv names (its first word after the root's own options), if any."""
    words = iter(hoist_global_options(argv))
    for word in words:
        if word in GLOBAL_VALUED:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


_full_app: typer.Typer | None = None


def __getattr__(name: str):
    """`app`: every command real, for the completion scripts and the tests that walk the whole tree."""
    global _full_app
    if name != "app":
        raise AttributeError(name)
    if _full_app is None:
        _full_app = build_app(everything=True)
    return _full_app
