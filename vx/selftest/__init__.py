"""vx selftest: prove an install on this machine (run.py), its one-pass (one_pass.py) and S3 (upload.py) stages."""
