"""Differential testing: every kernel on several backends against a NumPy float64 reference."""
