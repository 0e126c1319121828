"""The command layer: parse options, call kvctl.core / kvctl.clients, render with kvctl.output."""
