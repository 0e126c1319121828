"""What every room uses: kvctl's own paths, safe reading of user files, what may be shown."""
