"""Do parallel ranged GETs help a node's direct download from the object store? (issue 13)

    .venv/bin/python bench/direct_bench.py [--size-mb 200] [--repeat 3]
        [--setting PARALLEL:PART_MB ...] [--server moto|plain] [--url PRESIGNED_GET] [--json]

Times ``ObjectStore.open_ranged`` (client/direct.py): the parallel ranged reader under
``open_archive``, without its zstd decompression, so this measures transfer, not zstd. Each
download reads the whole object to the end in 1 MiB ``read``s and discards them, with a
fresh ``ObjectStore`` (as one ``pull`` has), from the first GET to the last byte.

Without ``--url``: a real S3 API server on loopback (moto, ``moto_server``), one object of
``--size-mb`` MiB of random bytes (an archive is zstd: incompressible) put with boto3, and a
presigned SigV4 GET of it, signed as cachekeeper/backends/s3.py signs. With ``--url``: that presigned
GET (of any object; its size is read from a 1-byte range), nothing started.

Settings are PARALLEL:PART_MB (PART_MB ``whole`` = one GET of the whole object, i.e. one
plain stream); default 1:whole, 1:8, 4:8 (today's PARALLEL and PART_BYTES), 8:8, 4:32.
An untimed first round reads every setting once and checks its bytes (crc32). Then
``--repeat`` rounds, each in a rotated order of the settings (so drift on a shared host
spreads over all of them). Reported per setting: the median MB/s (MB = 10^6 bytes), the
ratio to the one-stream row (the first ``whole`` setting, else the first), and the median
CPU seconds of this process (the client's threads) per download. Nothing asserts a time.

Caveat for the loopback numbers: moto answers each ranged GET by copying the whole object
out of its buffer and slicing it (moto.s3 ``FakeKey.value``), and it is one Python process:
there, every part costs the server O(object size), which real stores (S3, Ceph RGW, MinIO)
do not. ``--server plain`` serves the same random object from a stdlib range server in a
child process (each part a slice of memory, no copy, no signature check): the client's and
loopback's ceiling. Loopback has no per-connection bandwidth limit or latency, which is
where parallel ranges pay off; use ``--url`` against a real store to answer for a site.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
from botocore.config import Config

from cachekeeper.client.direct import PARALLEL, PART_BYTES, DirectUnavailable, ObjectStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.helpers.moto_server import MOTO_ENV, MotoServer, start_moto  # noqa: E402

MIB = 1 << 20
READ_BYTES = 1 << 20
DEFAULT_SETTINGS = ("1:whole", "1:8", f"{PARALLEL}:{PART_BYTES // MIB}", "8:8", "4:32")


@dataclass(frozen=True)
class Setting:
    parallel: int
    part_bytes: int | None  # None: the whole object in one GET

    @property
    def label(self) -> str:
        part = "whole" if self.part_bytes is None else f"{self.part_bytes // MIB} MiB"
        return f"{self.parallel} x {part}"


@dataclass(frozen=True)
class Download:
    seconds: float
    cpu_s: float
    size_bytes: int
    crc32: int


@dataclass(frozen=True)
class Row:
    setting: str
    parallel: int
    part_bytes: int
    median_mb_s: float
    ratio: float
    median_cpu_s: float
    runs_mb_s: tuple[float, ...]


def parse_setting(text: str) -> Setting:
    """``PARALLEL:PART_MB`` (PART_MB a number of MiB or ``whole``) -> Setting."""
    parallel, _, part = text.partition(":")
    try:
        setting = Setting(
            parallel=int(parallel), part_bytes=None if part == "whole" else int(part) * MIB
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"setting {text!r} is not PARALLEL:PART_MB (e.g. 4:8 or 1:whole)"
        ) from None
    if setting.parallel < 1 or (setting.part_bytes is not None and setting.part_bytes < 1):
        raise argparse.ArgumentTypeError(f"setting {text!r}: PARALLEL and PART_MB must be >= 1")
    return setting


def download(url: str, setting: Setting, *, size_bytes: int, check: bool) -> Download:
    """Read the object at ``url`` to the end through the ranged reader; time it."""
    part_bytes = setting.part_bytes or size_bytes
    crc = 0
    read_bytes = 0
    cpu_start = time.process_time()
    start = time.perf_counter()
    with ObjectStore(timeout_s=300.0) as objects:
        stream = objects.open_ranged(url, part_bytes=part_bytes, parallel=setting.parallel)
        try:
            while chunk := stream.read(READ_BYTES):
                read_bytes += len(chunk)
                if check:
                    crc = zlib.crc32(chunk, crc)
        finally:
            stream.close()
    seconds = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start
    if read_bytes != size_bytes:
        raise RuntimeError(f"{setting.label}: read {read_bytes} bytes of {size_bytes}")
    return Download(seconds=seconds, cpu_s=cpu_s, size_bytes=read_bytes, crc32=crc)


def object_size(url: str) -> int:
    """The size of the object behind a presigned GET (from a 1-byte range's Content-Range)."""
    with ObjectStore() as objects:
        response = objects.get_range(url, 0, 0, deadline=None)
    if response.status_code == 200:
        return len(response.content)
    return int(response.headers["content-range"].rsplit("/", 1)[1])


def put_object(moto: MotoServer, *, size_bytes: int) -> tuple[str, int]:
    """Put ``size_bytes`` random bytes into a fresh bucket; (presigned GET, crc32)."""
    bucket = moto.new_bucket().removeprefix("s3://").split("/", 1)[0]
    s3 = boto3.session.Session().client(
        "s3",
        endpoint_url=moto.url,
        aws_access_key_id=MOTO_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=MOTO_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=MOTO_ENV["AWS_DEFAULT_REGION"],
        config=Config(signature_version="s3v4"),
    )
    data = os.urandom(size_bytes)
    s3.put_object(Bucket=bucket, Key="bench/archive.tar.zst", Body=data)
    url: str = s3.generate_presigned_url(
        "get_object",
        Params={"Bucket": bucket, "Key": "bench/archive.tar.zst"},
        ExpiresIn=3600,
    )
    return url, zlib.crc32(data)


class _RangeHandler(BaseHTTPRequestHandler):
    """GET of the one object, whole (200) or one ``Range: bytes=A-B`` (206), from memory."""

    protocol_version = "HTTP/1.1"  # keep-alive, as a store's
    data = memoryview(b"")

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        size = len(self.data)
        start, end = 0, size - 1
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if found is not None:
            start, end = int(found.group(1)), min(int(found.group(2)), size - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self.wfile.write(self.data[start : end + 1])

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass


def serve_plain(size_bytes: int) -> None:
    """The ``--server plain`` child: print ``PORT CRC32`` and serve until stdin closes."""
    data = os.urandom(size_bytes)
    _RangeHandler.data = memoryview(data)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.server_address[1], zlib.crc32(data), flush=True)
    sys.stdin.read()  # the parent closes our stdin (or dies): stop
    server.shutdown()


def start_plain(size_bytes: int) -> tuple[subprocess.Popen[str], str, int]:
    """A stdlib range server in a child process; (process, URL, crc32 of its object)."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-plain-bytes", str(size_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    port, crc = child.stdout.readline().split()
    return child, f"http://127.0.0.1:{port}/bench/archive.tar.zst?X-Amz-Signature=none", int(crc)


def run(
    url: str, settings: list[Setting], *, size_bytes: int, repeat: int, expected_crc: int | None
) -> list[Row]:
    """One checked untimed round, then ``repeat`` rotated rounds; a Row per setting."""
    for setting in settings:
        got = download(url, setting, size_bytes=size_bytes, check=True)
        expected_crc = got.crc32 if expected_crc is None else expected_crc
        if got.crc32 != expected_crc:
            raise RuntimeError(f"{setting.label}: the bytes read differ from the object's")
    runs: dict[int, list[Download]] = {i: [] for i in range(len(settings))}
    for round_no in range(repeat):
        for k in range(len(settings)):
            i = (k + round_no) % len(settings)
            runs[i].append(download(url, settings[i], size_bytes=size_bytes, check=False))
            print(
                f"round {round_no + 1}/{repeat} {settings[i].label}:"
                f" {size_bytes / runs[i][-1].seconds / 1e6:.1f} MB/s",
                file=sys.stderr,
                flush=True,
            )
    medians = [statistics.median(size_bytes / d.seconds / 1e6 for d in runs[i]) for i in runs]
    base = next((i for i, s in enumerate(settings) if s.part_bytes is None), 0)
    return [
        Row(
            setting=setting.label,
            parallel=setting.parallel,
            part_bytes=setting.part_bytes or size_bytes,
            median_mb_s=round(medians[i], 1),
            ratio=round(medians[i] / medians[base], 2),
            median_cpu_s=round(statistics.median(d.cpu_s for d in runs[i]), 3),
            runs_mb_s=tuple(round(size_bytes / d.seconds / 1e6, 1) for d in runs[i]),
        )
        for i, setting in enumerate(settings)
    ]


def table(rows: list[Row], *, size_bytes: int, repeat: int, source: str) -> str:
    lines = [
        f"{size_bytes / MIB:.0f} MiB from {source}, median of {repeat}:",
        "| parallel x part | MB/s | vs one stream | client CPU s |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r.setting} | {r.median_mb_s} | {r.ratio:.2f}x | {r.median_cpu_s} |" for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200, help="object size in MiB (moto)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument(
        "--setting",
        dest="settings",
        action="append",
        type=parse_setting,
        metavar="PARALLEL:PART_MB",
        help=f"repeatable; default {' '.join(DEFAULT_SETTINGS)}",
    )
    parser.add_argument("--url", default=None, help="time this presigned GET; start no moto")
    parser.add_argument(
        "--server",
        choices=("moto", "plain"),
        default="moto",
        help="without --url: moto (S3 API, default) or plain (a stdlib range server that"
        " serves each part from memory: the client's and loopback's ceiling)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--serve-plain-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_plain_bytes is not None:
        serve_plain(args.serve_plain_bytes)
        return
    if args.size_mb < 1 or args.repeat < 1:
        parser.error("--size-mb and --repeat must be >= 1")
    settings = args.settings or [parse_setting(s) for s in DEFAULT_SETTINGS]
    moto = plain = None
    expected_crc: int | None
    try:
        if args.url is not None:
            url, expected_crc, source = args.url, None, "--url"
            size_bytes = object_size(url)
        elif args.server == "plain":
            size_bytes = args.size_mb * MIB
            plain, url, expected_crc = start_plain(size_bytes)
            source = "a stdlib range server on loopback"
        else:
            moto = start_moto()
            size_bytes = args.size_mb * MIB
            url, expected_crc = put_object(moto, size_bytes=size_bytes)
            source = "moto on loopback"
        rows = run(
            url, settings, size_bytes=size_bytes, repeat=args.repeat, expected_crc=expected_crc
        )
    except DirectUnavailable as exc:
        parser.exit(1, f"direct_bench: {exc}\n")
    finally:
        if moto is not None:
            moto.stop()
        if plain is not None:
            plain.communicate(timeout=30)  # closes its stdin: it stops
    if args.json:
        out = {
            "source": source,
            "size_bytes": size_bytes,
            "repeat": args.repeat,
            "cpu_count": os.cpu_count(),
            "rows": [asdict(row) for row in rows],
        }
        print(json.dumps(out, indent=2))
    else:
        print(table(rows, size_bytes=size_bytes, repeat=args.repeat, source=source))


if __name__ == "__main__":
    main()
