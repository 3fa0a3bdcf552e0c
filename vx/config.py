"""One flat, validated configuration for an extraction run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import UsageError

BACKENDS = ("auto", "hf", "vllm")
MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")
OVERLONG = ("truncate", "skip")


@dataclass
class ExtractConfig:
    data: Path
    output: Path
    model: str | None = None                 # local HF dir; None = embedded tiny default
    backend: str = "auto"                    # auto = vllm when importable, else hf
    layers: list[int] | None = None          # None = DFlash default for the model
    batch_size: int = 128                    # hf: max samples per forward
    max_batch_tokens: int = 65536            # hf: max padded tokens (batch x longest) per forward
    sort_window: int = 8192                  # hf: samples sorted by length together (bounded memory)
    max_length: int | None = None
    overlong: str = "truncate"
    dtype: str = "auto"                      # compute dtype of the model
    store_dtype: str = "bf16"
    shard_size_mb: float = 1024.0
    strict: bool = False
    overwrite: bool = False
    device: str | None = None                # hf: cuda if available, else cpu
    # vllm engine flags, named as vLLM names them
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None  # None: 0.9 on GPU, 0.3 of host memory on CPU
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    # S3 sink
    upload: str | None = None                # s3://bucket/prefix mirrored from the local output
    endpoint_url: str | None = None          # S3-compatible endpoint
    max_local_gb: float | None = None        # local shard bytes bound (backpressure)
    keep_local: bool = False
    compress: str | None = None              # None or "zstd": whole-shard compression
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if str(self.output).startswith("s3://"):  # stage locally, mirror to S3
            if self.upload and self.upload != str(self.output):
                raise UsageError("-o s3://... and --upload name two different targets")
            from .s3 import parse_s3_url, staging_dir

            self.upload = str(self.output)
            self.output = staging_dir(parse_s3_url(self.upload))
        if self.upload:
            from .s3 import parse_s3_url

            parse_s3_url(self.upload)
        if self.compress not in (None, "zstd"):
            raise UsageError(f"--compress must be zstd (or omitted), got {self.compress!r}")
        if self.max_local_gb is not None and self.max_local_gb <= 0:
            raise UsageError(f"--max-local-gb must be > 0, got {self.max_local_gb}")
        self.data, self.output = Path(self.data), Path(self.output)
        if not self.data.is_file():
            raise UsageError(f"dataset {str(self.data)!r} is not a file")
        if self.backend not in BACKENDS:
            raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in MODEL_DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        from .storage import STORE_DTYPES

        if self.store_dtype not in STORE_DTYPES:
            raise UsageError(f"--store-dtype must be one of {', '.join(STORE_DTYPES)}, got {self.store_dtype!r}")
        if self.overlong not in OVERLONG:
            raise UsageError(f"--overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}")
        for name in ("batch_size", "max_batch_tokens", "sort_window", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_length", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.shard_size_mb <= 0:
            raise UsageError(f"--shard-size must be > 0 MB, got {self.shard_size_mb}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["data"], d["output"] = str(self.data), str(self.output)
        return d
