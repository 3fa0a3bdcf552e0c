"""Pipelines that compose the jobs: `vx extract --regenerate` (one_pass.py)."""
