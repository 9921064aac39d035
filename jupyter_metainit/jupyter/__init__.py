"""Jupyter integration: the ``%%meta_init`` magics and the model tree widget."""

from __future__ import annotations
