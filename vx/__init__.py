"""vx: high-throughput extraction of target-layer hidden states for speculative-decoding drafters."""

__version__ = "0.1.0"

from vx.device import fork_safe as _fork_safe

_fork_safe()  # before any vx code asks torch about CUDA: later forks stay safe (vx/device.py)


def open_dataset(path):
    """Open an extraction output directory: `len(ds)`, `ds[i]` / `ds["id"]` -> dict of tensors."""
    from vx.store.reader import open_dataset as _open

    return _open(path)


def loader(path, tokens_per_batch: int, **kwargs):
    """Packed, shuffled, distributed, resumable training batches from a vx output (local or
    s3://): see vx/train/loader.py. `for batch in vx.loader("out/", tokens_per_batch=16384, rank=r,
    world_size=w, seed=0, epoch=e)` -> dict of hidden_states [sum T, L, H], input_ids, loss_mask,
    position_ids, cu_seqlens, sample_ids."""
    from vx.train.loader import Loader

    return Loader(path, tokens_per_batch, **kwargs)


__all__ = ["open_dataset", "loader", "__version__"]
