"""The one place that decides what kind of instance the selector flags name, and opens it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvctl.core.errors import UsageError
from kvctl.core.instance.protocol import Instance


@dataclass(frozen=True)
class Selector:
    """The selector flags every cache command takes, as given."""

    instance: str | None = None
    state: Path | None = None
    config: Path | None = None
    inventory: Path | None = None
    vllm_url: str | None = None
    coordinator: str | None = None
    # what makes the keys of an instance with no engine to ask (OfflineInstance)
    model: str | None = None
    kv_dtype: str | None = None
    world_size: int = 1
    hash_seed: str | None = None

    @property
    def fleet(self) -> bool:
        from kvctl.core.lmcache.controller import is_controller

        return self.instance == "all" or is_controller(self.instance)


def _refuse_another_configuration(selector: Selector, address) -> None:
    """--config beside a running instance that knows its own configuration (a kvctl serve's state)
    must name that configuration: acting on one engine with another's settings is a contradiction."""
    if selector.config is None or not address.config_dir:
        return
    given, own = Path(selector.config).expanduser().resolve(), Path(address.config_dir).expanduser().resolve()
    if given != own:
        raise UsageError(f"--config names {given}, but {address.name} runs with {own}",
                         hint="give that instance's own configuration, or leave --config out")


def open_instance(selector: Selector, address=None) -> Instance:
    """The instance the flags name: a configuration directory alone is an OfflineInstance; a running
    one (an --instance name or URL, a state file, the most recent kvctl serve, or a fleet member's
    `address`) is identified by asking it, and an MP server takes --config as its configuration."""
    from dataclasses import replace

    from kvctl.core.instance import addresses

    if address is None:
        if selector.config is not None and selector.instance is None and selector.state is None:
            from kvctl.core.instance.offline import OfflineInstance

            return OfflineInstance(selector.config, selector.model, selector.kv_dtype, selector.world_size,
                                   selector.hash_seed, selector.vllm_url)
        if selector.fleet:
            raise UsageError("this command addresses one instance, not --instance all",
                             hint="name one with --instance NAME")
        address = addresses.resolve(selector.instance, selector.state, selector.inventory)[0]
    if address.controller_only:
        from kvctl.core.instance.controller_only import ControllerOnlyInstance

        return ControllerOnlyInstance(address, selector.model)
    _refuse_another_configuration(selector, address)
    address = addresses.identify(address)
    if selector.config is not None and address.mode != "mp" and len(address.internal_api) == 1:
        from kvctl.core.lmcache.deployment import read_deployment

        if read_deployment(selector.config).mode == "mp":  # a URL that did not say what it is, of an MP config
            address = replace(address, mode="mp", internal_api=[], mp_http=address.internal_api[0])
    if selector.vllm_url:
        address = replace(address, vllm=selector.vllm_url)
    if address.mode == "mp" or not address.worker:
        from kvctl.core.instance.mp import MPInstance

        if selector.config is not None:
            address = replace(address, config_dir=str(selector.config))
        return MPInstance(address, selector)
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.core.errors import RoutesAbsent
    from kvctl.core.instance.inprocess import InProcessInstance

    worker = InternalAPIClient(address.worker)  # the instance keeps it for every operation
    try:
        info = worker.info()
    except RoutesAbsent:  # a stock LMCache engine: its own routes and its stores
        from kvctl.core.instance.stock import StockEngineInstance

        worker.close()
        return StockEngineInstance(address, selector.config, selector.model, selector.kv_dtype,
                                   selector.hash_seed, selector.vllm_url)
    except BaseException:
        worker.close()
        raise
    return InProcessInstance(address, info, worker)
