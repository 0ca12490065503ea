"""Values as users write them: job ids, sizes, durations, addresses and GCS URLs.

Each parser turns one flag's text into a value or raises :class:`UserError` naming the
flag, so configuration, the CSI plugin and the tiers share one reading of every value.
"""

from __future__ import annotations

import re

from tierfs.core.errors import UserError

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def check_job_id(job: str) -> None:
    """Job ids name directories on the host: no separators, nothing that starts with a dot."""
    if not _JOB_RE.match(job):
        raise UserError(
            f"invalid job id {job!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )


MAX_SIZE = float(1 << 62)


def parse_size(text: str, what: str = "size") -> int:
    """Parse ``4G``, ``512MiB``, ``1.5T`` or plain bytes; suffixes are binary, as tmpfs' ``size=``."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UserError(f"invalid {what} {str(text)[:40]!r}: use bytes or a number with K/M/G/T, e.g. 64G")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not n < MAX_SIZE:
        raise UserError(f"invalid {what} {str(text)[:40]!r}: larger than any machine's memory or disk")
    return int(n)


def parse_duration(text: str, what: str = "duration") -> float:
    """Parse ``90``, ``30s``, ``5m``, ``1h30m`` into seconds (a bare number is seconds)."""
    s = str(text).strip()
    try:
        return float(s)
    except ValueError:
        pass
    parts = _DURATION_RE.findall(s)
    if not parts or "".join(n + u for n, u in parts).lower() != s.lower():
        raise UserError(f"invalid {what} {text!r}: use seconds or e.g. 30s, 5m, 1h30m")
    return sum(float(n) * _SECONDS[u.lower()] for n, u in parts)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


COORDINATOR_PORT = 8476  # JAX's default coordinator port, as GKE's replicator assumes


def parse_address(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) into a (host, port) pair."""
    host, sep, port = str(text).strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"invalid {what} address {text!r}: use HOST:PORT, e.g. 10.0.0.2:7420")
    return host, int(port)


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]*[a-z0-9]")


def parse_gcs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; the prefix may be empty."""
    if not url.startswith("gs://"):
        raise UserError(f"invalid GCS URL {url!r}: use gs://BUCKET or gs://BUCKET/PREFIX")
    bucket, _, prefix = url[len("gs://") :].partition("/")
    parts = bucket.split(".")
    if not (3 <= len(bucket) <= 222 and _BUCKET_RE.fullmatch(bucket) and all(0 < len(p) <= 63 for p in parts)):
        raise UserError(
            f"invalid GCS bucket name {bucket!r} in {url!r}: use 3-63 lowercase letters, "
            "digits, '-', '_' or '.', starting and ending with a letter or digit"
        )
    prefix = prefix.rstrip("/")
    if prefix and ("" in prefix.split("/") or any(ord(c) < 0x20 for c in prefix)):
        raise UserError(f"invalid GCS prefix {prefix!r} in {url!r}: no empty path segments or control characters")
    return bucket, prefix
