"""Scheduler plugins: they start and stop worker processes on slots; the orchestrator decides."""
