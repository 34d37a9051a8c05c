"""Leaf layer: the error tree, clocks and deadlines, small OS utilities and file formats."""
