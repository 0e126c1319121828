"""The cache verbs: lookup, ls, prewarm, snapshots."""
