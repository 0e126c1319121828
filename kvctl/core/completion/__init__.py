"""Shell completion: static scripts and dynamic values."""
