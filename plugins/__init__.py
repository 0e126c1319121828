"""Code kvctl loads into LMCache / vLLM processes (management routes, the CPU connector).

It imports lmcache and vllm, never kvctl.cli.
"""
