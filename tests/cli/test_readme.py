"""The README cannot drift from the CLI: every example command line parses against the real CLI, and
every command, option and positional argument that the README names exists (sqlite-utils' docs
test is the model)."""

import re
import shlex
from pathlib import Path

import pytest
import typer

from kvctl.cli.app import GLOBAL_FLAGS, GLOBAL_VALUED, app, hoist_global_options

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
ROOT = typer.main.get_command(app)
EXAMPLES = [line[2:].split("  #")[0].split(" | ")[0].split(" && ")[0].strip()
            for line in README.splitlines() if line.startswith("$ kvctl ")]
MENTIONS = sorted({span for span in re.findall(r"`(kvctl [^`]+)`", README.replace("\\|", "|"))})


def is_group(command) -> bool:
    return hasattr(command, "list_commands")


def runs_itself(command) -> bool:
    """A group that is also a command (`kvctl pin` pins, `kvctl pin apply` is its subcommand): with no
    subcommand after its options, the group's own callback is the command that runs."""
    return is_group(command) and command.invoke_without_command


def command_of(words: list[str]) -> tuple:
    """(the command the words name, its path, the words after it); words may hold a|b alternatives."""
    command, path, rest = ROOT, [], list(words)
    while is_group(command) and rest and re.fullmatch(r"[a-z][a-z-]*(\|[a-z-]+)*", rest[0]):
        name = rest.pop(0).split("|")[0]
        found = command.get_command(command.make_context("kvctl", [], resilient_parsing=True), name)
        assert found is not None, f"no command {' '.join(path + [name])!r}"
        command, path = found, path + [name]
    return command, path, rest


def options_of(command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | set(GLOBAL_FLAGS) \
        | set(GLOBAL_VALUED) | {"--help"}


def test_the_readme_has_examples_and_mentions():
    assert len(EXAMPLES) >= 15 and len(MENTIONS) >= 30


@pytest.mark.parametrize("line", EXAMPLES)
def test_example_command_lines_parse(line):
    argv = hoist_global_options(shlex.split(line)[1:])
    context = ROOT.make_context("kvctl", argv, resilient_parsing=False)
    command, args, depth = ROOT, [*context._protected_args, *context.args], 0
    while is_group(command) and (args or not runs_itself(command)):
        assert args, f"{context.command_path} needs a subcommand"
        name, command, args = command.resolve_command(context, args)
        context = command.make_context(name, args, parent=context, resilient_parsing=False)
        args, depth = [*getattr(context, "_protected_args", []), *context.args], depth + 1
    assert depth >= 1  # a command (or a group that runs itself) was reached and its options and arguments parsed


@pytest.mark.parametrize("mention", MENTIONS)
def test_every_command_option_and_argument_the_readme_names_exists(mention):
    words = re.sub(r"[\[\](){}…]", " ", mention).split()[1:]
    command, path, rest = command_of(words)
    known, takes_value = options_of(command), False
    for word in rest:
        if word == "--":
            break
        if word.startswith("-"):
            for flag in word.split("=")[0].split("|"):
                assert flag in known, f"{' '.join(['kvctl', *path])} has no option {flag}"
            option = next((p for p in command.params if word.split("=")[0] in p.opts), None)
            takes_value = "=" not in word and option is not None and not getattr(option, "is_flag", False)
        elif word.isupper() or word.rstrip("s").isupper():
            assert takes_value or any(p.param_type_name == "argument" for p in command.params), \
                f"{' '.join(['kvctl', *path])} takes no positional {word}"
            takes_value = False
        else:
            takes_value = False
