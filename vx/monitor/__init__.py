"""What a running job reports about itself: its figures (meter), the live line (progress), the
device's peak and readings (peak, probe), and Prometheus metrics (metrics). Nothing here knows
an output's files: the jobs hand snapshots to vx.store.progress_log to publish them."""
