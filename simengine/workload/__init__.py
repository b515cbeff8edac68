"""Workloads: length distributions, arrival processes, multi-turn sessions and trace replay -> Requests."""
