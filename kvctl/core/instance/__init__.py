"""Instances: the protocol every cache command talks to, the one function that opens one, and its
implementations (in-process, MP, offline, stock, controller-only)."""
