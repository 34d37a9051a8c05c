"""The edge: command line and environment -> frozen config -> wiring -> exit code."""
