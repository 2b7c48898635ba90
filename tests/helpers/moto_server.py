"""A real S3 API server on loopback (moto in server mode) in a subprocess, for tests and benches.

handle = start_moto()            # moto_server on 127.0.0.1:<free port>
handle.env                       # AWS_* variables pointing boto3 (and the server) at it
url = handle.new_bucket()        # s3://<fresh bucket>/cachekeeper
handle.stop()

moto speaks the S3 wire protocol, presigned GET/PUT and ranged GETs included. It does not
enforce a presigned URL's expiry nor check ``x-amz-checksum-sha256``: tests of those paths
inject the failure themselves (see tests/server/test_s3_blobs.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import httpx

from tests.helpers.ports import free_port

__all__ = ["MotoServer", "start_moto", "MOTO_ENV"]

MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "cachekeeper-test",
    "AWS_SECRET_ACCESS_KEY": "cachekeeper-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}

_buckets = itertools.count()


@dataclass
class MotoServer:
    url: str
    process: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict)

    def new_bucket(self, *, prefix: str = "cachekeeper") -> str:
        """Create a fresh bucket; its ``s3://BUCKET/PREFIX`` URL."""
        name = f"ck-{os.getpid()}-{next(_buckets)}"
        client = boto3.session.Session().client("s3", endpoint_url=self.url, **_creds())
        client.create_bucket(Bucket=name)
        return f"s3://{name}/{prefix}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def _creds() -> dict[str, str]:
    return {
        "aws_access_key_id": MOTO_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": MOTO_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": MOTO_ENV["AWS_DEFAULT_REGION"],
    }


def start_moto(*, timeout_s: float = 30.0) -> MotoServer:
    """Start ``moto_server`` on a free loopback port and wait until it answers."""
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    port = free_port()
    process = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(f"{url}/moto-api/", timeout=2.0)
            break
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"moto_server did not start on {url}") from None
            time.sleep(0.1)
    return MotoServer(url=url, process=process, env={**MOTO_ENV, "AWS_ENDPOINT_URL_S3": url})
