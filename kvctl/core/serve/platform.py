"""Facts about this machine that kvctl's defaults and checks depend on."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# vLLM's KV block size: fixed at 128 tokens on the CPU backend, 16 by default on CUDA.
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16


def has_nvidia_gpu() -> bool:
    """True when an NVIDIA device node exists; cheap, no CUDA import."""
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def platform_name() -> str:
    return "gpu" if has_nvidia_gpu() else "cpu"


def vllm_block_size(platform: str | None = None) -> int:
    return GPU_BLOCK_SIZE if (platform or platform_name()) == "gpu" else CPU_BLOCK_SIZE


def available_memory_gb() -> float:
    """MemAvailable from /proc/meminfo, in GB (10^9 bytes would overstate GiB budgets; LMCache uses GiB)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 1024**3


def free_disk_gb(path: str | os.PathLike) -> float:
    """Free space of the file system that holds `path` (or would hold it, once created)."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free / 1024**3


def default_cpu_tier_gb() -> float:
    """A fifth of the free RAM, at most LMCache's own default of 5 GB, at least 0.5 GB."""
    return round(max(0.5, min(available_memory_gb() * 0.2, 5.0)), 1)


def default_disk_tier_gb(path: str | os.PathLike) -> float:
    """A tenth of the free disk at `path`, at most 50 GB, at least 1 GB."""
    return round(max(1.0, min(free_disk_gb(path) * 0.1, 50.0)), 1)
