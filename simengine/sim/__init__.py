"""The only SimPy code: replica engine loops, the router, arrival and session processes, the runner."""
