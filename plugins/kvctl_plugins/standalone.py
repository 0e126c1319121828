"""LMCache's standalone engine (`python -m lmcache.v1.standalone`) with kvctl's plugins loaded.

Usage: python -m kvctl_plugins.standalone [the standalone engine's own arguments]
"""

from kvctl_plugins import install

if __name__ == "__main__":
    install()
    from lmcache.v1.standalone.__main__ import main

    main()
