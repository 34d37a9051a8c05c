"""The store model (DESIGN.md section 3) and its implementations."""
