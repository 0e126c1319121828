"""kvctl's logic: no Typer, no Rich, nothing heavy imported at module level."""
