"""The selector and prompt flags are declared once (kvctl.cli.options) and reach a command as one value."""

import typer
from typer.testing import CliRunner

from kvctl.cli.app import command_tree
from kvctl.cli.options import SELECTOR_FLAGS, prompt_flags, selector_flags


def test_a_command_receives_its_flags_as_one_selector_and_one_prompt():
    seen = {}
    app = typer.Typer()

    @app.command()
    @prompt_flags
    @selector_flags("instance", "model", "world_size")
    def command(chosen, prompt, limit: int = 3) -> None:
        seen.update(chosen=chosen, prompt=prompt, limit=limit)

    done = CliRunner().invoke(app, ["--instance", "http://h:1", "--model", "m", "--world-size", "2",
                                    "--tokens-file", "t.json", "--limit", "5"])
    assert done.exit_code == 0, done.output
    assert (seen["chosen"].instance, seen["chosen"].model, seen["chosen"].world_size) == ("http://h:1", "m", 2)
    assert seen["chosen"].config is None and seen["prompt"].tokens_file == "t.json" and seen["limit"] == 5
    refused = CliRunner().invoke(app, ["--config", "x"])  # a flag the command did not take
    assert refused.exit_code == 2


def test_every_command_declares_a_selector_flag_the_same_way():
    """Every command that talks to an instance says the same about --model, --config, --state, ... (one
    declaration); kvctl serve and config init, which start or write one, mean other things by some of them."""
    flags = {f"--{name.replace('_', '-')}" for name in SELECTOR_FLAGS} - {"--instance"}
    helps: dict[str, set[str]] = {}

    def walk(command) -> None:
        takes_instance = any("--instance" in getattr(param, "opts", ()) for param in command.params)
        for param in command.params if takes_instance else ():
            for name in set(getattr(param, "opts", ())) & flags:
                helps.setdefault(name, set()).add(param.help)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(command_tree())
    assert set(helps) == flags
    assert {name: len(texts) for name, texts in helps.items()} == dict.fromkeys(flags, 1), helps
