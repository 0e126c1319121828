"""LMCache's own rules as kvctl reads them: configuration, schema, chunk keys, tokens, tiers, versions."""
