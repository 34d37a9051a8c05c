"""The worker template, the agent's side (the two sides: :mod:`elastrun.template`)."""
