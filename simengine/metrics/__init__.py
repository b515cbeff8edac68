"""Metrics: a recorder that appends rows in the hot loop, frames built once, vLLM-bench-style summaries."""
