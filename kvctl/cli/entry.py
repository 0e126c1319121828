"""The `kvctl` console script. Completion callbacks skip building the Typer app: they run on every <TAB>."""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["complete-values"] and len(argv) in (2, 3):
        from kvctl.core.completion.values import print_values

        print_values(argv[1], argv[2] if len(argv) == 3 else "")
        return
    from kvctl.cli.app import run

    sys.exit(run(argv))
