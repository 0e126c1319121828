"""What makes a member's chunk keys (and its versions), as compared across fleets, configurations and snapshots."""

from __future__ import annotations

from dataclasses import dataclass

UNSET = "(unset)"  # a PYTHONHASHSEED known to be absent, unlike None (not known)


SEED_FREE_ALGORITHMS = ("blake3",)  # MP's default hash: independent of PYTHONHASHSEED


@dataclass
class KeyFacts:
    """What makes a member's chunk keys (and its versions), as one source tells it; None: not known."""

    chunk_size: int | None = None
    hash_algorithm: str | None = None
    hash_seed: str | None = None
    model: str | None = None
    kv_dtype: str | None = None
    world_size: int | None = None
    lmcache_version: str | None = None
    vllm_version: str | None = None

    def seed_matters(self) -> bool:
        return self.hash_algorithm not in SEED_FREE_ALGORITHMS


KEY_FIELDS = {  # field -> (label, hint)
    "chunk_size": ("chunk size", "set the same chunk_size in every member's configuration (and no LMCACHE_CHUNK_SIZE "
                   "override)"),
    "hash_algorithm": ("hash algorithm", "set the same pre_caching_hash_algorithm (MP: --hash-algorithm) everywhere"),
    "hash_seed": ("PYTHONHASHSEED", "export the same PYTHONHASHSEED to every vLLM (env.sh)"),
    "model": ("model name", "give every vLLM the same --model value: a path and a hub id make different keys"),
    "kv_dtype": ("KV dtype", "run every vLLM with the same --dtype / --kv-cache-dtype"),
    "world_size": ("world size", "keys embed TP x PP: only members with the same world size share chunks"),
}


VERSION_FIELDS = {
    "lmcache_version": ("LMCache version", "upgrade every member to one LMCache version together"),
    "vllm_version": ("vLLM version", "upgrade every member to one vLLM version together"),
}
