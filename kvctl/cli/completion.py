"""Shell completion: static scripts rendered from the command tree, and the dynamic-value hook."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.options import Shell
from kvctl.core.errors import UsageError

app = typer.Typer(help="Shell completion scripts for bash, zsh and fish.", no_args_is_help=True)

EVERYWHERE = ("--format", "--debug", "-q", "--quiet")  # root options that kvctl accepts after any command
ROOT_ONLY = ("--show-completion", "--install-completion")
DYNAMIC_VALUES = {"--model": "models", "--instance": "instances"}
HELP = ("-h", "--help")
COMMAND_TREE = "kvctl.command_tree"  # ctx.meta: the whole CLI's root command, built on demand by the root


def command_specs(root):
    """The CLI as the completion renderers see it, read from its root command (the Typer app's click group)."""
    from kvctl.core.completion.scripts import CommandSpec, OptionSpec

    def value_kind(param) -> tuple[tuple[str, ...], str | None]:
        """(choices, "file"/"dir"/None) from Typer's description of the parameter's type."""
        annotation = param.type_descriptor.annotation
        if isinstance(annotation, type) and issubclass(annotation, Enum):
            return tuple(member.value for member in annotation), None
        if annotation is Path:
            return (), "dir" if param.type_descriptor.parameter_info.file_okay is False else "file"
        return (), None

    def option_spec(param) -> OptionSpec:
        names = tuple(param.opts) + tuple(param.secondary_opts) if param.param_type_name == "option" else ()
        choices, paths = value_kind(param)
        return OptionSpec(
            names=names,
            help=(param.help or "").split("\n")[0].strip(),
            takes_value=not getattr(param, "is_flag", False),
            choices=choices,
            paths=paths,
            dynamic=next((DYNAMIC_VALUES[name] for name in names if name in DYNAMIC_VALUES), None),
        )

    root_options = [option_spec(p) for p in root.params if p.param_type_name == "option" and not p.hidden]
    shared = [spec for spec in root_options if set(spec.names) & set(EVERYWHERE)]
    help_spec = OptionSpec(HELP, "Show help and exit.")
    specs = []

    def walk(command, path: str) -> None:
        options = [option_spec(p) for p in command.params if p.param_type_name == "option" and not p.hidden]
        if path:
            options += shared
        options.append(help_spec)
        listed = _listed(command)
        subcommands = {name: sub.get_short_help_str(limit=70) for name, sub in listed.items()}
        argument = next((option_spec(p) for p in command.params if p.param_type_name == "argument"), None)
        specs.append(CommandSpec(path, command.help.split("\n")[0] if command.help else "", options, subcommands,
                                 argument))
        for name, sub in listed.items():
            walk(sub, f"{path} {name}".strip())

    walk(root, "")
    return specs


def _listed(command) -> dict:
    """A group's visible subcommands in the order its help lists them."""
    if not hasattr(command, "list_commands"):
        return {}
    return {name: command.commands[name] for name in command.list_commands(None) if not command.commands[name].hidden}


def render(shell: str, root) -> str:
    """The script for `shell` over `root`, the whole CLI's root command (every command real)."""
    from kvctl.core.completion.scripts import RENDERERS

    return RENDERERS[shell](command_specs(root))


def detect_shell() -> str:
    name = os.path.basename(os.environ.get("SHELL", ""))
    if name not in ("bash", "zsh", "fish"):
        raise UsageError(f"cannot tell which shell to complete for (SHELL={name or 'unset'})",
                         hint="name it: kvctl completion show bash|zsh|fish")
    return name


def install_script(shell: str, root) -> Path:
    """Write the script where the shell finds it; add one line to the rc file when the shell needs it."""
    home = Path(os.path.expanduser("~"))
    if shell == "fish":
        target, rc_file, rc_line = home / ".config/fish/completions/kvctl.fish", None, None
    elif shell == "zsh":
        target, rc_file = home / ".zfunc/_kvctl", home / ".zshrc"
        rc_line = "fpath+=~/.zfunc; autoload -Uz compinit && compinit"
    else:
        target, rc_file = home / ".bash_completions/kvctl.sh", home / ".bashrc"
        rc_line = "source ~/.bash_completions/kvctl.sh"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render(shell, root))
    if rc_file is not None:
        existing = rc_file.read_text() if rc_file.exists() else ""
        if rc_line not in existing:
            with rc_file.open("a") as handle:
                handle.write(("" if existing.endswith("\n") or not existing else "\n") + rc_line + "\n")
    return target


@app.command("show")
def show(ctx: typer.Context, shell: Annotated[Shell | None, typer.Argument(help="bash, zsh or fish (default: "
                                                                            "from $SHELL).")] = None) -> None:
    """Print the completion script (the same text as completions/ in kvctl's repository)."""
    ctx.obj.text(render(shell.value if shell else detect_shell(), ctx.meta[COMMAND_TREE]()))


@app.command("install")
def install(ctx: typer.Context, shell: Annotated[Shell | None, typer.Argument(help="bash, zsh or fish (default: "
                                                                               "from $SHELL).")] = None) -> None:
    """Install the completion script for your shell (takes effect in a new shell)."""
    chosen = shell.value if shell else detect_shell()
    target = install_script(chosen, ctx.meta[COMMAND_TREE]())
    ctx.obj.emit({"shell": chosen, "path": str(target)}, [])
    ctx.obj.success(f"installed {chosen} completion in {target}; open a new shell to use it")


def complete_values(kind: Annotated[str, typer.Argument()], prefix: Annotated[str, typer.Argument()] = "") -> None:
    """Candidates for a dynamic value, one per line (called by the completion scripts)."""
    from kvctl.core.completion.values import print_values

    print_values(kind, prefix)
