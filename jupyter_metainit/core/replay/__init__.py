"""Replay: planning and running recorded ops to compute values."""
