"""S3 addressing (s3://bucket/prefix) and the one boto3 client configuration that every S3 reader
and writer of vx uses: dataset inputs, the output's uploader, the training loader's shard cache."""

from __future__ import annotations

from dataclasses import dataclass

from vx.errors import UsageError


@dataclass(frozen=True)
class S3Target:
    bucket: str
    prefix: str

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_s3_url(url: str) -> S3Target:
    if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
        raise UsageError(f"{url!r} is not an s3://bucket/prefix URL")
    bucket, _, prefix = url[5:].partition("/")
    return S3Target(bucket, prefix.strip("/"))


def make_client(endpoint_url: str | None, attempts: int = 10, connect_timeout: float = 10):
    import boto3
    from botocore.config import Config

    cfg = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=connect_timeout,
                 read_timeout=120)
    return boto3.client("s3", endpoint_url=endpoint_url, config=cfg)
