"""The flat, validated configurations of `vx extract` and `vx regenerate`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vx.data.chat import check_template_options
from vx.data.generation import Generation, check_generation
from vx.errors import UsageError
from vx.launch.options import Engines, check_engine_options, check_scale_out
from vx.monitor.metrics import check_options

BACKENDS = ("auto", "hf", "vllm")
MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")
OVERLONG = ("truncate", "skip")


@dataclass
class ExtractConfig(Engines, Generation):  # the engine, scale-out and generation options: vx/launch/options.py, vx/data/generation.py
    data: str                                # file, directory, glob or s3:// URL (vx/data/inputs.py)
    output: Path
    model: str | None = None                 # local HF dir; None = embedded tiny default
    backend: str = "auto"                    # auto = vllm when importable, else hf
    layers: list[int] | str | None = None    # ids, a preset name (vx.data.layers), None = DFlash's default
    batch_size: int = 128                    # hf: max samples per forward
    max_batch_tokens: int = 65536            # hf: max padded tokens (batch x longest) per forward
    sort_window: int = 8192                  # hf: samples sorted by length together (bounded memory)
    max_length: int | None = None
    overlong: str = "truncate"
    messages_field: str = "messages"         # the record field holding the conversation
    text_field: str = "text"
    id_field: str = "id"
    chat_template: str | None = None         # a Jinja template file overriding the tokenizer's
    chat_template_kwargs: str | None = None  # JSON object passed to the template, e.g. {"enable_thinking": false}
    verbose: bool = False                    # vLLM's INFO log live on stderr (always in OUT/logs/)
    dtype: str = "auto"                      # compute dtype of the model
    store_dtype: str = "bf16"
    shard_size_mb: float = 1024.0
    strict: bool = False
    overwrite: bool = False
    device: str | None = None                # hf: cuda if available, else cpu
    # vllm engine flags beside Engines', named as vLLM names them
    max_num_batched_tokens: int | None = None
    enforce_eager: bool | None = None        # None: compiled on GPU, the measured faster mode on CPU
    warm_up: bool = True                     # dummy prefills before the timed loop (vx/engine/vllm_engine.py)
    # S3 sink
    upload: str | None = None                # s3://bucket/prefix mirrored from the local output
    endpoint_url: str | None = None          # S3-compatible endpoint
    max_local_gb: float | None = None        # local shard bytes bound (backpressure)
    keep_local: bool = False
    retain_gb: float | None = None           # follow readers: delete consumed shards, hold at most this many GB
    compress: str | None = None              # None, "blocks" (vx/store/blocks.py) or "zstd" (whole shards)
    verify: int = 0                          # after the run: recompute this many random samples with HF
    # one pass (vx/jobs/one_pass.py): the target first writes the assistant turns (Generation), as vx regenerate
    regenerate: bool = False
    staged: bool = False                     # internal: output is the local staging dir of -o s3://
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        from vx.data.layers import PRESETS

        if isinstance(self.layers, str) and self.layers not in PRESETS:
            raise UsageError(f"--layers {self.layers!r} is not a preset ({', '.join(PRESETS)})")
        if str(self.output).startswith("s3://"):  # stage locally, mirror to S3
            if self.upload and self.upload != str(self.output):
                raise UsageError("-o s3://... and --upload name two different targets")
            from vx.store.s3_client import parse_s3_url
            from vx.store.output import staging_dir

            self.upload = str(self.output)
            self.output = staging_dir(parse_s3_url(self.upload), self.endpoint_url)
            self.staged = True
        if self.upload:
            from vx.store.s3_client import parse_s3_url

            parse_s3_url(self.upload)
        if self.compress not in (None, "blocks", "zstd"):
            raise UsageError(f"--compress must be blocks or zstd (or omitted), got {self.compress!r}")
        if self.compress == "blocks" and self.store_dtype == "fp32":
            raise UsageError("--compress blocks codes bf16, fp16 and fp8 states; with --store-dtype fp32 use zstd")
        if self.max_local_gb is not None and self.max_local_gb <= 0:
            raise UsageError(f"--max-local-gb must be > 0, got {self.max_local_gb}")
        if self.retain_gb is not None and self.retain_gb <= 0:
            raise UsageError(f"--retain-gb must be > 0, got {self.retain_gb}")
        if self.retain_gb is not None and self.keep_local:
            raise UsageError("--retain-gb deletes consumed shards, --keep-local keeps them: give one")
        self.data, self.output = str(self.data), Path(self.output)
        if not self.data.startswith("s3://"):
            self.source()  # a missing file, an empty glob or directory: refused before anything starts
        self._check_reading()
        if self.backend not in BACKENDS:
            raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in MODEL_DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        from vx.store.encoding import STORE_DTYPES

        if self.store_dtype not in STORE_DTYPES:
            raise UsageError(f"--store-dtype must be one of {', '.join(STORE_DTYPES)}, got {self.store_dtype!r}")
        if self.overlong not in OVERLONG:
            raise UsageError(f"--overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}")
        for name in ("batch_size", "max_batch_tokens", "sort_window"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_length", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.verify < 0:
            raise UsageError(f"--verify must be >= 0 samples, got {self.verify}")
        if self.shard_size_mb <= 0:
            raise UsageError(f"--shard-size must be > 0 MB, got {self.shard_size_mb}")
        check_engine_options(self)
        check_options(self)
        if self.regenerate:
            from vx.data.generation import check_generation

            check_generation(self)
        check_scale_out(self)

    def _check_reading(self) -> None:
        for name in ("messages_field", "text_field", "id_field"):
            if not getattr(self, name):
                raise UsageError(f"--{name.replace('_', '-')} must not be empty")
        check_template_options(self.chat_template, self.chat_template_kwargs)

    def source(self):
        """The input dataset (vx/data/inputs.py)."""
        from vx.data.inputs import Input

        return Input(self.data, self.endpoint_url)

    def reading(self):
        """How records become samples (vx/data/samples.py Reading): part of the partition plan's key."""
        
        from vx.data.samples import Reading

        template = Path(self.chat_template).read_text() if self.chat_template else None
        kwargs = json.dumps(json.loads(self.chat_template_kwargs or "{}"), sort_keys=True)
        return Reading(self.messages_field, self.text_field, self.id_field, template, kwargs, self.max_length,
                       self.overlong)

    @property
    def partitioned(self) -> bool:
        return self.partition_index is not None

    def portable_json(self) -> dict:
        """The config for a worker on any machine: -o s3://... is staged by each worker itself."""
        d = self.to_json()
        if self.staged:
            d.update(output=self.upload, upload=None, staged=False)
        return d

    def to_json(self) -> dict:
        d = asdict(self)
        d["output"] = str(self.output)
        return d


@dataclass
class RegenConfig(Engines, Generation):  # the engine, scale-out and generation options: vx/launch/options.py, vx/data/generation.py
    data: str
    output: Path
    model: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: str | None = None
    messages_field: str = "messages"
    id_field: str = "id"
    commit_every: int = 64                  # conversations per fsynced chunk (and at most 2 s apart)
    endpoint_url: str | None = None
    verbose: bool = False
    merge: bool = True                      # internal: the last partition done merges the parts (the one-pass
    #                                         launcher merges them itself, once every capture has read its part)

    def __post_init__(self):
        self.output = Path(self.output)
        check_generation(self)
        if self.commit_every < 1:
            raise UsageError(f"--commit-every must be >= 1, got {self.commit_every}")
        check_engine_options(self)
        check_options(self)
        self.template_kwargs = check_template_options(self.chat_template, self.chat_template_kwargs)
        if not (self.num_partitions > 1 and self.partition_index is None and self.data_parallel_size == 1
                and not self.ray and self.gpus is None):  # --num-partitions alone: one engine, in turn
            check_scale_out(self)

    def reading(self):
        """The partition plan's weights: each conversation's tokens as `vx extract` reads it (the
        original assistant turns stand in for the lengths the target will write)."""
        from vx.data.samples import Reading

        template = Path(self.chat_template).read_text() if self.chat_template else None
        return Reading(self.messages_field, "text", self.id_field, template,
                       json.dumps(self.template_kwargs, sort_keys=True))

    def to_json(self) -> dict:
        d = asdict(self)
        d["output"] = str(self.output)
        return d
