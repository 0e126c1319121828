"""`kvctl serve`: launch plans, the supervisor, the tiny model, the machine's facts."""
