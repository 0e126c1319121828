"""Dynamic completion values (`kvctl complete-values KIND PREFIX`), one per line."""

from __future__ import annotations

from kvctl.core.common.paths import cache_dir, model_dir_candidates


def instance_names(prefix: str) -> list[str]:
    """`all`, the inventory's instances and the names of running `kvctl serve`s."""
    from kvctl.core.errors import KvctlError
    from kvctl.core.instance.addresses import find_inventory, read_inventory

    names = sorted(path.parent.name for path in (cache_dir() / "serve").glob("*/state.json"))
    try:
        inventory = find_inventory()
        if inventory:
            names = ["all", *read_inventory(inventory)["instances"], *names]
    except KvctlError:
        pass  # a broken inventory completes nothing from it; the command itself will say why
    return [name for name in dict.fromkeys(names) if name.startswith(prefix)]


VALUE_KINDS = {"models": model_dir_candidates, "instances": instance_names}


def print_values(kind: str, prefix: str) -> None:
    for candidate in VALUE_KINDS.get(kind, lambda _prefix: [])(prefix):
        print(candidate)
