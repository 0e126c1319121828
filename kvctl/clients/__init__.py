"""One small client per server kvctl talks to; no Typer, no Rich."""
