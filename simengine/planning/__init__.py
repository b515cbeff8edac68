"""Planning: capacity under an SLO."""
