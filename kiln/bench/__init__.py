"""`kiln bench`: benchmarks a user runs against their own model directory (startup: compile and first-token times)."""
