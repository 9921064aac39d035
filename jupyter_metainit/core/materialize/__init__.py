"""Materialization: deferred tensors become real in place, and back."""
