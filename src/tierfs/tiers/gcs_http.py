"""Requests to one GCS bucket: the client, quick retries, and failures as this package's errors.

Apart from the store because none of it knows what the objects are: it makes one request,
retries a transient failure for about a second, then raises :class:`GcsUnavailable`
(the caller owns the long backoff), and turns every other failure into one line naming
the operation and the gs:// URL. The library's own retries are turned off because they
would hide an outage for two minutes per request. Everything is synchronous, for worker
threads; one client (and its HTTP connection pool) serves all of them.
"""

from __future__ import annotations

import functools
import http.client
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import requests
import urllib3
from google.api_core import exceptions as api
from google.auth import exceptions as auth
from google.auth.credentials import AnonymousCredentials, Credentials
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption

from tierfs.core.errors import UserError
from tierfs.core.parse import parse_gcs_url
from tierfs.tiers.gcs_identity import IdentityRefused

T = TypeVar("T")

RETRY_DELAYS = (0.2, 1.0)  # sleeps between the three attempts of one request
CONNECT_TIMEOUT = 10.0  # a connect that takes longer is an outage, however big the object
POOL_SIZE = 32  # pooled connections: room for the tier's worker threads plus the collector's (gcs_gc.GC_THREADS)
LIST_PAGE = 1000
CONTENT_TYPE = "application/octet-stream"

_TRANSIENT: tuple[type[BaseException], ...] = (
    api.TooManyRequests,
    api.InternalServerError,
    api.BadGateway,
    api.ServiceUnavailable,
    api.GatewayTimeout,
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.TimeoutError,
    http.client.HTTPException,  # e.g. a body cut short
    ConnectionError,
    TimeoutError,
    auth.TransportError,  # the token endpoint is unreachable
    DataCorruption,  # checksum mismatch in transit: the stored object is fine
)
_DENIED = (api.Unauthorized, api.Forbidden, auth.RefreshError)


class GcsError(Exception):
    """A GCS request failed; the message names the operation and the gs:// URL."""


class GcsUnavailable(GcsError):
    """GCS could not be reached or answered 429/5xx, even after quick retries: try later."""


class MissingObject(GcsError):
    """The object does not exist (HTTP 404)."""


class CorruptObject(GcsError):
    """An object this module must understand is unreadable.

    The collector stops on one rather than guess which chunks it protects.
    """


class MissingBucket(GcsError, UserError):
    """The bucket does not exist: only the user can fix that."""


class GcsAccessDenied(GcsError, UserError):
    """The credentials may not do this (HTTP 401/403): no retry helps, access must be granted."""


class GcsBucket:
    """Requests to one bucket, made by any thread; :class:`~tierfs.tiers.gcs_store.GcsStore` builds on it."""

    def __init__(self, url: str, client: storage.Client | None = None, timeout: float = 30):
        self.bucket, self.prefix = parse_gcs_url(url)
        self._client = client
        self._client_lock = threading.Lock()
        self._timeout = (min(timeout, CONNECT_TIMEOUT), timeout)

    @property
    def client(self) -> storage.Client:
        """Created on first use, so that merely configuring GCS needs no credentials yet."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = make_client()
        return self._client

    def url_of(self, name: str) -> str:
        return f"gs://{self.bucket}/{name}"

    def _bucket(self) -> storage.Bucket:
        return self.client.bucket(self.bucket)

    def _blob(self, name: str) -> storage.Blob:
        # A Blob caches the object's properties: one per request, never shared by threads.
        return self._bucket().blob(name)

    def _upload(self, name: str, data: bytes, **preconditions: int) -> storage.Blob:
        """One request up to 8 MiB; larger objects take a one-chunk resumable session.

        Returns the blob with the properties GCS answered (generation, MD5).
        """

        def send() -> storage.Blob:
            blob = self._blob(name)
            blob.upload_from_string(data, content_type=CONTENT_TYPE, retry=None, timeout=self._timeout, **preconditions)
            return blob

        try:
            return self._call("upload", name, send)
        except api.NotFound:
            raise self._missing_bucket() from None

    def _download(self, name: str, limit: int, generation: int | None = None) -> bytes:
        """The object's bytes if it has at most ``limit``; else :class:`CorruptObject`.

        The request asks for ``limit + 1`` stored bytes (an HTTP range), so an oversized
        object costs no more than that to find out about.
        """

        def get() -> bytes:
            blob = self._bucket().blob(name, generation=generation)
            try:
                # One read of the whole body, not 8 KiB steps: objects are a chunk at most,
                # and the stepwise loop holds the GIL long enough to stall the FUSE thread.
                # Raw: the stored bytes, never inflated on the way in (tierfs sets no
                # Content-Encoding; a planted gzip one would otherwise be a bomb).
                data: bytes = blob.download_as_bytes(
                    start=0, end=limit, raw_download=True, retry=None, timeout=self._timeout, single_shot_download=True
                )
                return data
            except api.RequestRangeNotSatisfiable:
                return b""  # an empty object has no byte 0 to start from

        try:
            data = self._call("download", name, get)
        except api.NotFound:
            raise MissingObject(f"{self.url_of(name)} does not exist") from None
        if len(data) > limit:
            raise CorruptObject(
                f"{self.url_of(name)} is larger than {limit} bytes, more than any object tierfs writes there"
            )
        return data

    def _delete(self, name: str) -> None:
        """Delete if present: a retry after a lost response finds nothing, and that is fine."""
        try:
            self._call("delete", name, lambda: self._blob(name).delete(retry=None, timeout=self._timeout))
        except api.NotFound:
            pass

    def _list(self, prefix: str, fields: str, page_size: int | None = None) -> Iterator[storage.Blob]:
        """Objects under ``prefix``, a page at a time: a failed page is retried, not the listing."""
        token: str | None = None
        while True:
            page = functools.partial(self._page, prefix, token, fields, page_size)
            try:
                blobs, token = self._call("list", prefix, page)
            except api.NotFound:
                raise self._missing_bucket() from None
            yield from blobs
            if not token:
                return

    def _page(
        self, prefix: str, token: str | None, fields: str, size: int | None = None
    ) -> tuple[list[storage.Blob], str | None]:
        iterator = self.client.list_blobs(
            self.bucket,
            prefix=prefix,
            page_token=token,
            page_size=size or LIST_PAGE,
            fields=f"{fields},nextPageToken",
            retry=None,
            timeout=self._timeout,
        )
        page = next(iterator.pages, None)
        return (list(page) if page is not None else []), iterator.next_page_token

    def _call(self, what: str, name: str, request: Callable[[], T]) -> T:
        """Make one request, retrying transient failures a few times, quickly."""
        for delay in RETRY_DELAYS:
            try:
                return self._once(what, name, request)
            except GcsUnavailable:
                time.sleep(delay)
        return self._once(what, name, request)

    def _once(self, what: str, name: str, request: Callable[[], T]) -> T:
        """Map failures to this module's errors; 404 and 412 pass: their meaning is the caller's."""
        try:
            return request()
        except (api.NotFound, api.PreconditionFailed):
            raise
        except _TRANSIENT as e:
            raise GcsUnavailable(f"cannot {what} {self.url_of(name)}: {_reason(e)}") from e
        except _DENIED as e:
            raise GcsAccessDenied(self._denied(what, name, e)) from None
        except api.GoogleAPICallError as e:
            raise GcsError(f"cannot {what} {self.url_of(name)}: {_reason(e)}") from e

    def _denied(self, what: str, name: str, e: BaseException) -> str:
        """One line naming what to grant to whom: the node's credentials, or the job's own identity."""
        if isinstance(e, IdentityRefused):  # the job's token was refused before GCS was asked
            return f"cannot {what} {self.url_of(name)}: {e}"
        grantee = getattr(getattr(self._client, "_credentials", None), "grantee", None)
        if grantee is None:
            return (
                f"cannot {what} {self.url_of(name)}: access denied ({_reason(e)}); "
                f"let tierfs's credentials read and write objects in gs://{self.bucket}"
            )
        return (
            f"cannot {what} {self.url_of(name)} as the job's identity: access denied ({_reason(e)}); "
            f"grant roles/storage.objectUser on gs://{self.bucket} to {grantee()}"
        )

    def _missing_bucket(self) -> MissingBucket:
        return MissingBucket(f"GCS bucket gs://{self.bucket} does not exist: create it or fix --gcs")


def make_client(credentials: Credentials | None = None) -> storage.Client:
    """A client with ``credentials`` (the job's own identity: :mod:`tierfs.tiers.gcs_identity`),
    even against an emulator; without, anonymous against an emulator (STORAGE_EMULATOR_HOST)
    and default credentials otherwise."""
    if credentials is not None:
        client = storage.Client(credentials=credentials, project=None)
    elif os.environ.get("STORAGE_EMULATOR_HOST"):
        anonymous = AnonymousCredentials()  # type: ignore[no-untyped-call]  # google-auth leaves its __init__ untyped
        client = storage.Client(credentials=anonymous, project="tierfs")
    else:
        try:
            client = storage.Client()
        except auth.DefaultCredentialsError:
            raise UserError(
                "no Google Cloud credentials for --gcs: attach a service account, set "
                "GOOGLE_APPLICATION_CREDENTIALS, or run 'gcloud auth application-default login'"
            ) from None
    # The library shares one requests session between threads, which it documents as safe.
    # Past the default 10 pooled connections per host, requests opens throwaway ones: a new
    # TLS handshake per request, and a warning each time, with 16 threads at work.
    session = client._http
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=POOL_SIZE)
    for scheme in ("https://", "http://"):
        if type(session.get_adapter(scheme)) is requests.adapters.HTTPAdapter:  # not mTLS
            session.mount(scheme, adapter)
    return client


def _reason(e: BaseException) -> str:
    """The gist of a failure for a one-line message: ``HTTP 503: ...``, ``Connection refused``."""
    if isinstance(e, api.GoogleAPICallError) and e.code:
        message = re.sub(r"^[A-Z]+ \S+: ", "", e.message)  # the request line: URL and all
        return f"HTTP {e.code} {message}"[:300]
    text = str(e)
    errno = re.search(r"\[Errno -?\d+\] ([^'\"()\]]+)", text)
    if errno:
        return errno[1].strip()
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__
