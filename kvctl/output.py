"""The one output sink: data on stdout (Rich tables or stable JSON), everything else on stderr.

Commands build a JSON-able payload plus, for humans, a table view of it; they never print
directly. Rich is imported on first use so that `--help` and completion stay fast; Rich itself
honours NO_COLOR and drops styling when the stream is not a terminal.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvctl.core.common.display import escape_controls


def default_format() -> str:
    """Tables for a person at a terminal, JSON when stdout is piped."""
    return "table" if sys.stdout.isatty() else "json"


class Output:
    def __init__(self, fmt: str | None = None, quiet: bool = False) -> None:
        self.format = fmt or default_format()
        self.quiet = quiet
        self._stdout = None
        self._stderr = None

    @property
    def json(self) -> bool:
        return self.format == "json"

    def _console(self, err: bool):
        from rich.console import Console

        if err:
            if self._stderr is None:
                self._stderr = Console(stderr=True, highlight=False, soft_wrap=True)
            return self._stderr
        if self._stdout is None:
            self._stdout = Console(highlight=False, soft_wrap=True)
        return self._stdout

    # -- data (stdout) ---------------------------------------------------------------------

    def emit(self, payload: Any, tables: Iterable[Table | str] = ()) -> None:
        """Print the result: `payload` as JSON, or for humans the given tables and lines (Rich markup)."""
        if self.json:
            import json

            sys.stdout.write(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
            sys.stdout.flush()
            return
        console = self._console(err=False)
        for item in tables:
            console.print(item if isinstance(item, str) else item.render())

    def watch(self, frame: Callable[[], tuple[Any, list[Table | str]]], interval: float) -> None:
        """Redraw `frame()`'s tables in place every `interval` seconds until Ctrl-C (a terminal view)."""
        import time

        from rich.console import Group
        from rich.live import Live

        def renderable():
            _payload, items = frame()
            return Group(*(item if isinstance(item, str) else item.render() for item in items))

        with Live(renderable(), console=self._console(err=False), auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(renderable(), refresh=True)

    def text(self, text: str) -> None:
        """Raw data for stdout that is not a table (a generated script, a key list)."""
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()

    # -- messages (stderr) -----------------------------------------------------------------

    @contextmanager
    def status(self, message: str) -> Iterator[Callable[[str], None]]:
        """A live status line on a terminal (a spinner with the latest message); elsewhere each new
        phase once, as a plain line. Yields the function that updates it."""
        if self.quiet:
            yield lambda _message: None
            return
        console = self._console(err=True)
        if console.is_terminal:
            with console.status(escape(message)) as live:
                yield lambda text: live.update(escape(text))
            return
        last = [None]

        def update(text: str) -> None:
            phase = re.sub(r"\s*\(\d+ s\)$", "", text)
            if phase != last[0]:
                last[0] = phase
                console.print(printable(phase), markup=False)

        update(message)
        yield update

    @contextmanager
    def progress(self, total: int, description: str) -> Iterator[Callable[[int], None]]:
        """A progress bar on a terminal (items, tokens/s, ETA); nothing elsewhere. Yields advance(tokens)."""
        console = self._console(err=True)
        if self.quiet or not console.is_terminal:
            yield lambda _tokens: None
            return
        import time

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        started, tokens = time.monotonic(), [0]
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console) as bar:
            task = bar.add_task(description, total=total, rate="")

            def advance(count: int) -> None:
                tokens[0] += count
                rate = tokens[0] / max(time.monotonic() - started, 1e-6)
                bar.update(task, advance=1, rate=f"{rate:,.0f} tokens/s")

            yield advance

    def info(self, message: str) -> None:
        if not self.quiet:
            self._console(err=True).print(printable(message), markup=False)

    def success(self, message: str) -> None:
        if not self.quiet:
            self._console(err=True).print(f"[green]✓[/green] {escape(message)}")

    def warn(self, message: str) -> None:
        self._console(err=True).print(f"[yellow]warning:[/yellow] {escape(message)}")

    def error(self, message: str, hint: str | None = None) -> None:
        console = self._console(err=True)
        console.print(f"[bold red]error:[/bold red] {escape(message)}")
        if hint:
            console.print(f"[cyan]hint:[/cyan] {escape(hint)}")


class Table:
    """A table description that stays plain data until it is rendered."""

    def __init__(self, columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None,
                 caption: str | None = None) -> None:
        self.columns = list(columns)
        self.rows = [["" if cell is None else str(cell) for cell in row] for row in rows]
        self.title = title
        self.caption = caption

    def render(self):
        from rich.table import Table as RichTable

        table = RichTable(title=self.title and escape(self.title), caption=self.caption and escape(self.caption),
                          title_justify="left", caption_justify="left")
        for column in self.columns:
            table.add_column(column, overflow="fold")
        for row in self.rows:
            table.add_row(*(escape(cell, lines=False) for cell in row))
        return table


def printable(text: str, lines: bool = True) -> str:
    """`text` with control characters (terminal escapes, bidi overrides; newlines and tabs too unless
    `lines`) escaped as kvctl.core.common.display.escape_controls writes them: a stored key or a server's
    message must never drive the terminal."""
    return escape_controls(text, keep_lines=lines)


def escape(text: str, lines: bool = True) -> str:
    """Plain text for a Rich markup string: printable, with Rich's markup escaped."""
    from rich.markup import escape

    return escape(printable(text, lines))
