"""Pins: pin sets, the MP pin ledger, TTL durations."""
