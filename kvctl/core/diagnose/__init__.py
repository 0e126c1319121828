"""doctor, health, stats, top: what a deployment answers and why it would miss."""
