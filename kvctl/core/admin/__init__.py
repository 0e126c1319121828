"""LMCache's management surface: freeze, backends, conf, quotas, reconfiguration, chunk statistics."""
