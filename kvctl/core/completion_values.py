"""Dynamic completion values (`kvctl complete-values KIND PREFIX`), one per line."""

from __future__ import annotations

from kvctl.core.paths import model_dir_candidates

VALUE_KINDS = {"models": model_dir_candidates}


def print_values(kind: str, prefix: str) -> None:
    for candidate in VALUE_KINDS.get(kind, lambda _prefix: [])(prefix):
        print(candidate)
