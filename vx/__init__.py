"""vx: high-throughput extraction of target-layer hidden states for speculative-decoding drafters."""

__version__ = "0.1.0"


def open_dataset(path):
    """Open an extraction output directory: `len(ds)`, `ds[i]` / `ds["id"]` -> dict of tensors."""
    from .reader import open_dataset as _open

    return _open(path)


__all__ = ["open_dataset", "__version__"]
