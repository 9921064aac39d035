"""The machinery of :func:`~jupyter_metainit.estimates.dry_run`: running a model's forward pass
on stand-ins and measuring it (activations, FLOPs, eager's dtype errors), model untouched.

``dry_run.py`` is the entry point; each module here does one part of the run.
"""
