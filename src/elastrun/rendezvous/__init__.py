"""Rendezvous: membership rounds, ranks and bootstrap addresses, over the store model."""
