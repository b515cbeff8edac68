"""Fidelity: predict published measurements, calibrate the named cost terms, and report the error.

`simengine validate FILE.csv` (validate/cli.py) reads rows (measurements.py), turns each into an experiment
(experiments.py), runs it (run.py) and reports (report.py); `simengine calibrate FILE.csv` fits the named
efficiency and overhead terms (calibrate.py). See docs/validation.md.
"""
