"""Where one running instance's parts answer: what every command that talks to a running instance starts from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Address:
    """Where one running instance's parts answer (its URLs, state and configuration), before anyone asks."""

    name: str
    mode: str = "inprocess"  # "inprocess" or "mp"
    internal_api: list[str] = field(default_factory=list)  # scheduler, then worker 0, 1, ...
    vllm: str | None = None
    offload_socket: str | None = None
    mp_http: str | None = None
    config_dir: str | None = None
    model: str | None = None
    problem: str | None = None  # why a fleet member could not be found (or must not be asked)
    coordinator: str | None = None  # the LMCache coordinator kvctl serve started (MP mode)
    controller: str | None = None  # LMCache's controller that listed this instance (in-process fleets)
    heartbeat_age_s: float | None = None  # how long ago the controller last heard from it
    hint: str | None = None  # what to do about `problem`

    @property
    def controller_only(self) -> bool:
        """Registered with a controller that answers for it, its own servers not found."""
        return bool(self.controller) and not (self.internal_api or self.mp_http or self.problem)

    @property
    def worker(self) -> str | None:
        """Worker 0's internal API URL, where kvctl's routes answer for the engine."""
        return self.internal_api[1] if len(self.internal_api) > 1 else (self.internal_api or [None])[0]
