"""kvctl: operate the KV cache of vLLM + LMCache from the command line."""

__version__ = "0.1.0"
