"""Leaf layer: event and metric sinks."""
