"""Supervision of worker processes: starting, watching and stopping them, and reporting failures."""
