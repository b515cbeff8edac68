"""Configuration: frozen dataclasses for scenarios, hardware and models, loaded strictly from YAML/JSON."""
