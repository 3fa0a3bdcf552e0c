"""Shard transfers through awscrt's S3 client: the uploader's multipart uploads and the training
loader's whole-shard downloads (file I/O, part requests, signing, retries) run in C threads, off
the driver's or the trainer's interpreter and GIL.

Measured here against moto over HTTP (bench/upload.py, docs/performance.md): boto3's `upload_file`
spends ~1.7-1.8 user core-s per GB in Python (s3transfer reads each part into memory, http.client
sends it, over plain HTTP botocore signs the payload), and beside a busy driver loop it starves for
the GIL (7-8x slower); this client 0.15-0.25, keeping ~0.85 of its rate beside the loop.

What is kept from the boto3 path: the same endpoint, addressing style, region and credentials as the
botocore client vx makes (`vx/store/s3_client.py`; the URL comes from that client, the credentials are
read through it on every request, so refreshing ones refresh); the full-object CRC64-NVME sent with
the upload so that S3 checks it on receipt (multipart included); ~10 retries of 5xx and throttling
with backoff. `VX_S3_CLIENT=boto3` selects the boto3 path instead, for both directions (an
S3-compatible store that rejects the CRT's requests).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from urllib.parse import urlsplit

from vx.errors import VxError

THREADS = 2  # event-loop threads: enough for ~10 Gbit/s of plain sends; TLS would want more


def wanted() -> bool:
    """Whether shard uploads and downloads go through the CRT client (the default) rather than boto3."""
    choice = os.environ.get("VX_S3_CLIENT", "crt").lower()
    if choice not in ("crt", "boto3"):
        raise VxError(f"VX_S3_CLIENT={choice!r}: use crt (the default) or boto3")
    return choice == "crt"


class CrtS3:
    """put(path, bucket, key, headers, on_part, on_progress): one object from a file; get(bucket, key,
    path): one object into a file. Multipart (ranged GETs) above `part_bytes`, `concurrency` parts in
    flight. Built from the boto3 client the uploader or the loader uses."""

    def __init__(self, client, part_bytes: int, concurrency: int = 8):
        from awscrt.auth import AwsCredentials, AwsCredentialsProvider
        from awscrt.io import ClientBootstrap, ClientTlsContext, DefaultHostResolver, EventLoopGroup, TlsContextOptions
        from awscrt.s3 import S3Client, S3RequestTlsMode, S3RetryConfig

        self.client = client
        creds = client._get_credentials()  # the botocore client's own (refreshing); boto3's CRT path reads them so too
        if creds is None:
            raise VxError("no AWS credentials for S3 transfers: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a "
                          "profile, or an instance role")

        def current():
            f = creds.get_frozen_credentials()
            return AwsCredentials(f.access_key, f.secret_key, f.token)

        https = urlsplit(client.meta.endpoint_url).scheme == "https"
        tls = None
        if https and os.environ.get("AWS_CA_BUNDLE"):
            opts = TlsContextOptions()
            opts.override_default_trust_store_from_path(ca_filepath=os.environ["AWS_CA_BUNDLE"])
            tls = ClientTlsContext(opts).new_connection_options()
        loop = EventLoopGroup(THREADS)
        self._s3 = S3Client(bootstrap=ClientBootstrap(loop, DefaultHostResolver(loop)),
                            region=client.meta.region_name or "us-east-1",
                            credential_provider=AwsCredentialsProvider.new_delegate(current),
                            tls_mode=S3RequestTlsMode.ENABLED if https else S3RequestTlsMode.DISABLED,
                            tls_connection_options=tls, part_size=part_bytes, multipart_upload_threshold=part_bytes,
                            memory_limit=max(1 << 30, (concurrency + 2) * part_bytes),
                            max_active_connections_override=concurrency,
                            retry_config=S3RetryConfig(max_retries=9), connect_timeout_ms=10_000)
        self.part_bytes = part_bytes

    def put(self, path: Path, bucket: str, key: str, headers: dict[str, str], on_part=None, on_progress=None) -> None:
        """Upload the file at `path` as s3://bucket/key with `headers` (x-amz-...); blocks until S3
        has the object. `on_part(k)` runs before part k's bytes are read to be sent (multipart only,
        k from 1), `on_progress(n)` as n more bytes are sent; both on a CRT thread, and an error
        raised by either cancels the upload and is raised here. Raises VxError naming S3's answer
        when the upload fails after the retries."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        # where botocore would send a PutObject of this key (addressing style, endpoint, escaping)
        url = urlsplit(self.client.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": key}))
        size = Path(path).stat().st_size
        h = HttpHeaders([("Host", url.netloc), ("Content-Length", str(size)),
                         ("Content-Type", "application/octet-stream"), *headers.items()])
        failed: list[BaseException] = []
        req = None

        def guarded(fn):
            def call(*a):
                try:
                    return fn(*a)
                except BaseException as e:  # noqa: BLE001 - handed to the caller below
                    failed.append(e)
                    if req is not None:
                        req.cancel()
                    raise
            return call

        with open(path, "rb", buffering=0) as f:
            body = _Parts(f, self.part_bytes if size > self.part_bytes else 0, guarded(on_part or (lambda k: None)))
            req = self._s3.make_request(type=S3RequestType.PUT_OBJECT, request=HttpRequest("PUT", url.path, h, body),
                                        on_progress=guarded(on_progress) if on_progress else None)
            try:
                req.finished_future.result()
            except Exception as e:  # noqa: BLE001 - S3's answer, in one line
                if failed:
                    raise failed[0] from None
                raise _failed("PutObject", bucket, key, e) from e
        if failed:
            raise failed[0]

    def get(self, bucket: str, key: str, path: Path) -> None:
        """The object s3://bucket/key into the file at `path` (written by the CRT's threads, in ranged
        GETs of `part_bytes`); blocks until it is there. Raises VxError naming S3's answer."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        url = urlsplit(self.client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}))
        req = self._s3.make_request(type=S3RequestType.GET_OBJECT, recv_filepath=str(path),
                                    request=HttpRequest("GET", url.path, HttpHeaders([("Host", url.netloc)])))
        try:
            req.finished_future.result()
        except Exception as e:  # noqa: BLE001 - S3's answer, in one line
            raise _failed("GetObject", bucket, key, e) from e


def _failed(op: str, bucket: str, key: str, e: BaseException) -> VxError:
    status = getattr(e, "status_code", None)
    op = getattr(e, "operation_name", None) or op
    return VxError(f"{op} of s3://{bucket}/{key} failed" + (f" (HTTP {status})" if status else "")
                   + f": {getattr(e, 'name', type(e).__name__)} (a store that rejects the CRT client's requests: "
                   "VX_S3_CLIENT=boto3 sends through boto3)")


class _Parts(io.RawIOBase):
    """The file as the CRT reads it: one read per part (measured: a 64 MiB read each, in the C
    client's buffers, the GIL released during the read), each announced to `on_part` first."""

    def __init__(self, f, part_bytes: int, on_part):
        super().__init__()
        self.f, self.part_bytes, self.on_part, self._next = f, part_bytes, on_part, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readinto(self, b) -> int:
        if self.part_bytes:
            k = self.f.tell() // self.part_bytes
            if k >= self._next:
                self._next = k + 1
                self.on_part(k + 1)
        return self.f.readinto(b)
