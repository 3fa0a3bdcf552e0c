"""Training from an output: the loader (packed, shuffled, distributed, resumable batches), its
epoch plan, and the bounded, checked shard cache it reads S3 outputs through."""
