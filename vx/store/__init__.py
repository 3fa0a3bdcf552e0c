"""An extraction output: the shard format and its encoding, the shard writer, the output's one
owner (identity, resume, lock), S3 (addresses and the one client configuration, preflight,
remote state, the uploader), and the reader."""
