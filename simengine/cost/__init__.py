"""Step-time models: a roofline with named efficiency terms (and, optionally, measured tables)."""
