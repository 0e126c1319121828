"""`kvctl config` and `kvctl plugins`: writing, showing and validating configurations."""
