"""Passes that tidy the graph around the fusions: no-op elimination first, dead code after."""
