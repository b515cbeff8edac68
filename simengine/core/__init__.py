"""Plain data shared by engines, the simulator and metrics: requests and scheduler outputs."""
