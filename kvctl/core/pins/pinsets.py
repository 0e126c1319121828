"""Pin sets: prompts to keep pinned, declared once in a YAML file and re-applied (after every engine start).

    name: system-prompts
    pins:
      - prompt_file: prompts/*.txt        # globs, relative to this file's directory
        ttl: 2h                           # 600, 30s, 10m, 2h, 1d (default: until unpinned)
      - chat: chats/support.json
        tiers: [cpu]                      # default: whichever of cpu and disk the engine has
      - tokens_file: ids/preamble.json

Applying a set reconciles an instance's pins with the file, as a plan (the dry run) and its execution:
the entries not pinned are pinned, the pinned ones with a TTL are pinned again (a fresh TTL; and the
chunks cached since), and the pins this set made that the file no longer lists are released. Pins of
other sets and plain `kvctl pin` pins are never touched.

Membership lives in the pin id, so that it survives in the engine and needs no side file:
`set-NAME-DIGEST`, DIGEST the first 12 hex digits of a SHA-256 over the entry's kind, its path
relative to the set file, its tiers and its token ids. The same file on the same tokens gives the same
id, so re-applying finds its pins; a changed prompt is a new pin (and the old one is released).

The MP coordinator's pins have no ids (it counts pins per key): there the set's pins are found in a
ledger kvctl keeps (kvctl.core.pins.ledger), and an entry may have no `ttl` or `tiers` (a coordinator
pin holds a prompt's chunks in every L2 tier until it is released).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvctl.core.errors import KvctlError, RejectedError, UsageError
from kvctl.core.instance.protocol import PIN_SET_ID, SET_NAME_MAX, Unsupported
from kvctl.core.pins.durations import parse_duration

KINDS = ("prompt_file", "chat", "tokens_file")
ENTRY_KEYS = (*KINDS, "ttl", "tiers")
FILE_KEYS = ("name", "pins")
TIERS = ("cpu", "disk", "redis", "all")
DIGEST_CHARS = 12
SHAPE_HINT = "a pin set is `name: NAME` and `pins:`, a list of {prompt_file|chat|tokens_file: PATH, ttl:, tiers:}"


@dataclass(frozen=True)
class Entry:
    """One prompt of a set: a file of one kind (one match of a glob), with its TTL and tiers."""

    kind: str  # prompt_file, chat or tokens_file
    path: Path
    label: str  # the path relative to the set file's directory, as shown and hashed
    ttl_s: float | None = None
    tiers: tuple[str, ...] | None = None

    def source(self):
        from kvctl.core.lmcache.tokens import PromptSource

        return PromptSource(**{self.kind: str(self.path)})


@dataclass
class PinSet:
    name: str
    path: Path
    entries: list[Entry]

    def pin_id(self, entry: Entry, tokens: list[int]) -> str:
        digest = hashlib.sha256(json.dumps([entry.kind, entry.label, list(entry.tiers or []), tokens]).encode())
        return f"set-{self.name}-{digest.hexdigest()[:DIGEST_CHARS]}"

    def holds(self, pin_id: str) -> bool:
        return set_of(pin_id) == self.name


def set_of(pin_id: str) -> str | None:
    """The set whose pin this is (None: a plain pin)."""
    match = PIN_SET_ID.fullmatch(pin_id)
    return match.group(1) if match else None


# -- the file ------------------------------------------------------------------------------------


def _bad(path: Path, message: str, hint: str = SHAPE_HINT) -> KvctlError:
    return KvctlError(f"{path}: {message}", hint=hint)


def load(path: Path) -> PinSet:
    """The set a file declares, every glob expanded; one line and a hint for whatever is wrong."""
    import yaml

    from kvctl.core.common.safe_files import load_yaml_file

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no pin set file at {path}", hint="give the path of a pin set YAML file")
    try:
        data = load_yaml_file(path)
    except (OSError, yaml.YAMLError) as error:
        raise _bad(path, f"not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise _bad(path, "is not a mapping")
    unknown = [str(key) for key in data if key not in FILE_KEYS]
    if unknown:
        raise _bad(path, f"unknown key {unknown[0]!r}", "a pin set has only `name:` and `pins:`")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(path, "has no `name:`", "name the set: name: system-prompts")
    if not PIN_SET_ID.fullmatch(f"set-{name}-{'0' * DIGEST_CHARS}") or len(name) > SET_NAME_MAX:
        fixed = "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in name)[:SET_NAME_MAX]
        raise _bad(path, f"set name {name!r} is not 1-{SET_NAME_MAX} letters, digits, '-' or '_'",
                   f"it is part of every pin id: e.g. name: {fixed}")
    raw = data.get("pins")
    if not isinstance(raw, list) or not raw:
        raise _bad(path, "has no entries under `pins:`", "list the prompts: pins: [{prompt_file: prompt.txt}]")
    entries: list[Entry] = []
    seen: dict[tuple[str, str], int] = {}
    for number, item in enumerate(raw, 1):
        for entry in _entries(path, number, item):
            where = seen.setdefault((entry.kind, entry.label), number)
            if where != number:
                raise _bad(path, f"pins[{number}] and pins[{where}] both name {entry.label}",
                           "a file belongs to one entry: narrow a glob")
            entries.append(entry)
    return PinSet(name, path, entries)


def _entries(path: Path, number: int, item: Any) -> list[Entry]:
    where = f"pins[{number}]"
    if not isinstance(item, dict):
        raise _bad(path, f"{where} is not a mapping")
    unknown = [str(key) for key in item if key not in ENTRY_KEYS]
    if unknown:
        raise _bad(path, f"{where}: unknown key {unknown[0]!r}", f"an entry's keys: {', '.join(ENTRY_KEYS)}")
    kinds = [kind for kind in KINDS if kind in item]
    if len(kinds) != 1:
        raise _bad(path, f"{where} has {'none' if not kinds else ' and '.join(kinds)} of {', '.join(KINDS)}",
                   "give each entry exactly one of prompt_file:, chat:, tokens_file:")
    kind = kinds[0]
    pattern = item[kind]
    if not isinstance(pattern, str) or not pattern:
        raise _bad(path, f"{where}: {kind} is not a path", f"e.g. {kind}: prompts/*.txt")
    ttl_s = _ttl(path, where, item.get("ttl"))
    tiers = _tiers(path, where, item.get("tiers"))
    base = path.parent
    full = os.path.join(base, os.path.expanduser(pattern))
    matches = sorted(Path(found) for found in glob.glob(full) if Path(found).is_file())
    if not matches:
        raise _bad(path, f"{where}: {kind} {pattern!r} matches no file (relative to {base})",
                   "fix the path or glob; paths are relative to the pin set file's directory")
    return [Entry(kind, match, Path(os.path.relpath(match, base)).as_posix(), ttl_s, tiers) for match in matches]


def _ttl(path: Path, where: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad(path, f"{where}: bad ttl {value!r}", "write it as 600, 30s, 10m, 2h or 1d")
    try:
        return parse_duration(str(value))
    except UsageError as error:
        raise _bad(path, f"{where}: {error.message}", error.hint) from None


def _tiers(path: Path, where: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    tiers = [value] if isinstance(value, str) else value
    if not isinstance(tiers, list) or not tiers or not all(isinstance(t, str) and t in TIERS for t in tiers):
        raise _bad(path, f"{where}: bad tiers {value!r}", f"a list of {', '.join(TIERS)}, e.g. tiers: [cpu]")
    return tuple(tiers)


# -- plan and apply --------------------------------------------------------------------------------

PIN, REFRESH, RELEASE, UNCHANGED = "pin", "refresh", "release", "unchanged"


@dataclass(frozen=True)
class Step:
    """What applying does with one pin: an entry's (pin, refresh, unchanged) or a stale one's (release)."""

    action: str
    pin_id: str
    entry: Entry | None = None
    tokens: list[int] = field(default_factory=list, repr=False)
    why: str | None = None  # why a refresh
    chunks: int | None = None
    cached_chunks: int | None = None  # of the entry's chunks, those the pin holds on its fullest tier
    pinned: dict[str, int] | None = None
    prewarm: str | None = None  # "prefilled", or why not, when chunks of the entry were not cached
    error: str | None = None
    recorded: dict[str, Any] | None = field(default=None, repr=False)  # MP: the ledger's record when planned

    def as_dict(self) -> dict[str, Any]:
        answer: dict[str, Any] = {"action": self.action, "pin_id": self.pin_id}
        if self.entry is not None:
            answer.update({"kind": self.entry.kind, "file": self.entry.label, "ttl_s": self.entry.ttl_s,
                           "tiers": list(self.entry.tiers) if self.entry.tiers else None, "tokens": len(self.tokens)})
        answer.update({"why": self.why, "chunks": self.chunks, "cached_chunks": self.cached_chunks,
                       "pinned": self.pinned, "prewarm": self.prewarm})
        if self.error:
            answer["error"] = self.error
        return answer


@dataclass(frozen=True)
class Application:
    """A set's plan on one instance (a dry run), or what applying it did."""

    set: str
    file: str
    instance: str
    steps: tuple[Step, ...]
    dry_run: bool = True

    def of(self, action: str) -> list[Step]:
        return [step for step in self.steps if step.action == action]

    @property
    def errors(self) -> dict[str, str]:
        return {(step.entry.label if step.entry else step.pin_id): step.error for step in self.steps if step.error}

    def as_dict(self) -> dict[str, Any]:
        answer: dict[str, Any] = {"set": self.set, "file": self.file, "dry_run": self.dry_run,
                                  "counts": {action: len(self.of(action))
                                             for action in (PIN, REFRESH, RELEASE, UNCHANGED)},
                                  "steps": [step.as_dict() for step in self.steps]}
        if self.errors:
            answer["errors"] = self.errors
        return answer


def plan(pin_set: PinSet, instance, model: str | None = None) -> Application:
    """The diff of the set against the instance's pins: nothing changes."""
    if not instance.pin_ids:
        return _ledger_plan(pin_set, instance, model)
    held = {pin.pin_id: pin for pin in instance.pins(model).pins}  # pins with ids: kvctl's own (Pin)
    steps: list[Step] = []
    wanted: set[str] = set()
    for entry in pin_set.entries:
        tokens = instance.tokenize(entry.source(), model)
        pin_id = pin_set.pin_id(entry, tokens)
        wanted.add(pin_id)
        pin = held.get(pin_id)
        if pin is None:
            steps.append(Step(PIN, pin_id, entry, tokens))
            continue
        cached = _cached(pin)
        why = ("ttl" if entry.ttl_s is not None else "ttl dropped" if pin.expires is not None
               else "uncached chunks" if cached < pin.chunks else None)
        steps.append(Step(UNCHANGED if why is None else REFRESH, pin_id, entry, tokens, why, pin.chunks, cached,
                          dict(pin.pinned)))
    for pin_id, pin in held.items():
        if pin_set.holds(pin_id) and pin_id not in wanted:
            steps.append(Step(RELEASE, pin_id, None, [], None, pin.chunks, _cached(pin), dict(pin.pinned)))
    return Application(pin_set.name, str(pin_set.path), instance.name, tuple(steps))


def _ledger_plan(pin_set: PinSet, instance, model: str | None) -> Application:
    """The diff against what the set's ledger says it pinned through the coordinator, where the
    coordinator still holds it (a lost pin is pinned again)."""
    from kvctl.core.pins.ledger import Ledger

    # The ledger before the coordinator's pins: a pin another kvctl makes in between is then one this plan
    # has not seen recorded (its step is skipped under the lock), never one recorded and not held ("lost").
    ledger = Ledger(instance.pin_scope(), pin_set.name)
    pinned = {pin.key for pin in instance.pins(model).pins}
    steps: list[Step] = []
    wanted: set[str] = set()
    for entry in pin_set.entries:
        if entry.ttl_s is not None or entry.tiers:
            raise Unsupported(f"{pin_set.path}: {entry.label} has a ttl or tiers, which {instance.name}'s pins (the "
                              "MP coordinator's) do not take: they hold a prompt's chunks in every L2 tier until "
                              "released", hint="drop ttl: and tiers: from the set's entries for MP instances")
        tokens = instance.tokenize(entry.source(), model)
        pin_id = pin_set.pin_id(entry, tokens)
        wanted.add(pin_id)
        keys = [chunk.key for chunk in instance.lookup(tokens, model).chunks]
        held = sum(key in pinned for key in keys)
        recorded = pin_id in ledger.entries
        action = UNCHANGED if recorded and held else PIN
        why = "lost by the coordinator (restarted without --metadata-path?)" if recorded and not held else None
        steps.append(Step(action, pin_id, entry, tokens, why, len(keys), held, recorded=ledger.entries.get(pin_id)))
    steps += [Step(RELEASE, pin_id, None, record["tokens"], recorded=record)
              for pin_id, record in ledger.entries.items() if pin_id not in wanted]
    return Application(pin_set.name, str(pin_set.path), instance.name, tuple(steps))


def execute(application: Application, instance, model: str | None = None, prewarm: bool = True) -> Application:
    """Release, refresh (pin again under the same id, which replaces the old pin only once the new one
    holds: the chunks are never unpinned in between) and pin, step by step: a step that fails carries its
    error and the others go on. With `prewarm` and an instance whose vLLM is known, an
    entry with chunks not cached is first prefilled through it (kvctl.core.cache.prewarm). MP: under the
    ledger's lock, a step whose record another kvctl changed since the plan is left to what it did."""
    from kvctl.core.pins.ledger import Ledger

    if instance.pin_ids:
        return _execute(application, instance, model, prewarm, None)
    with Ledger(instance.pin_scope(), application.set).locked() as ledger:
        return _execute(application, instance, model, prewarm, ledger)


def _execute(application: Application, instance, model: str | None, prewarm: bool, ledger) -> Application:
    order = {RELEASE: 0, REFRESH: 1, PIN: 2, UNCHANGED: 3}
    steps = list(application.steps)
    for index in sorted(range(len(steps)), key=lambda index: order[steps[index].action]):
        steps[index] = _execute_step(steps[index], instance, model, prewarm, ledger)
    return replace(application, steps=tuple(steps), dry_run=False)


def _execute_step(step: Step, instance, model: str | None, prewarm: bool, ledger) -> Step:
    """One step applied: the step as it went (its counts and prefill, or its error)."""

    if step.action == UNCHANGED:
        return step
    if ledger is not None and ledger.entries.get(step.pin_id) != step.recorded:
        return replace(step, action=UNCHANGED, why="applied by another kvctl since the plan")
    try:
        if step.action == RELEASE and ledger is not None:
            instance.unpin(tokens=step.tokens, model=ledger.entries[step.pin_id]["model"])
            ledger.forget(step.pin_id)
            return step
        if step.action == RELEASE:
            try:
                instance.unpin(pin_id=step.pin_id, model=model)
            except RejectedError:  # gone since the plan (its TTL ended): nothing left to release
                pass
            return step
        entry = step.entry
        if prewarm and instance.vllm_url:
            try:
                step = replace(step, prewarm=_prewarm(instance, step, model))
            except KvctlError as error:  # pinned all the same: what is cached is held
                step = replace(step, prewarm=f"not prefilled: {error.message}")
        if ledger is not None:  # the coordinator's pin: no id, no ttl, no tiers
            held = instance.pin(step.tokens, None, None, model)
            step = replace(step, chunks=held.requested, cached_chunks=min(held.affected, held.requested))
            ledger.record(step.pin_id, entry.label, held.model, step.tokens)
            return step
        pin = instance.pin(step.tokens, entry.ttl_s, entry.tiers, model, pin_id=step.pin_id,
                           replace=step.action == REFRESH)
        return replace(step, chunks=pin.chunks, cached_chunks=_cached(pin), pinned=dict(pin.pinned))
    except KvctlError as error:
        return replace(step, error=error.message)


def apply(path: Path, instance, dry_run: bool = False, model: str | None = None, prewarm: bool = True) -> Application:
    application = plan(load(path), instance, model)
    return application if dry_run else execute(application, instance, model, prewarm)


PREWARM_SETTLE_S = 10.0  # how long a prefilled prompt's chunks get to land in the cache


def _prewarm(instance, step: Step, model: str | None) -> str | None:
    """Prefill the entry through the instance's vLLM when some of its chunks are not cached, and wait
    until they are: "prefilled", or why not (the entry is pinned anyway); None when all were cached."""
    import time

    from kvctl.clients.vllm import VLLMClient
    from kvctl.core.cache.prewarm import Prompt, prefill
    from kvctl.core.lmcache.tokens import read_chat, read_text

    def uncached() -> int:
        return sum(1 for chunk in instance.lookup(step.tokens, model).chunks if not chunk.tiers)

    if not uncached():
        return None
    entry = step.entry
    if entry.kind == "chat":
        prompt = Prompt(entry.label, messages=read_chat(str(entry.path)))
    else:  # vLLM's completions take token ids as the prompt, too
        prompt = Prompt(entry.label, text=read_text(str(entry.path)) if entry.kind == "prompt_file" else step.tokens)
    with VLLMClient(instance.vllm_url) as vllm:
        served = vllm.models()[0]
    (outcome,), _seconds = prefill(instance.vllm_url, served, [prompt], 1)
    if outcome.error:
        return f"prefill failed: {outcome.error}"
    deadline = time.monotonic() + PREWARM_SETTLE_S
    while (missing := uncached()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return "prefilled" if not missing else f"prefilled; {missing} chunks not cached after {PREWARM_SETTLE_S:g} s"


def _cached(pin) -> int:
    return max(pin.pinned.values(), default=0)


def apply_after_start(state_file: Path, path: Path) -> Application:
    """`kvctl serve --pins`: apply the set to the instance a state file describes (the one just started)."""
    from kvctl.core.instance import addresses
    from kvctl.core.instance.opening import Selector, open_instance
    from kvctl.core.serve.state import read_state

    return apply(path, open_instance(Selector(), addresses.from_state(read_state(Path(state_file)))))
