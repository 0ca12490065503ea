"""The job's own GCS identity: its Kubernetes service-account token exchanged for Google access tokens.

Without it every daemon on a node reaches GCS as the node (its service account, through the
metadata server), so every job on the node may read and write every other job's backups.
With ``--gcs-token-file`` the daemon is the job instead, as GKE Workload Identity Federation
allows: the CSI plugin writes the pod's Kubernetes service-account token to that file (kubelet
refreshes it), and whenever a new access token is needed the file is read again and the token
exchanged at Google's Security Token Service (OAuth 2.0 token exchange, RFC 8693) for an
access token of the job's IAM principal; with ``--gcs-service-account`` that token then
impersonates a Google service account (IAM Credentials ``generateAccessToken``).

The exchange itself is google-auth's :class:`google.auth.identity_pool.Credentials`; this
module gives it the file (a supplier that re-reads it, refusing symbolic links and anything
over 64 KiB), a transport that caps what an endpoint may answer and treats 429/5xx as
transient, one refresh at a time, and failures as one line naming what to grant to whom.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import requests
from google.auth import exceptions as auth
from google.auth import identity_pool
from google.auth import transport as auth_transport

from tierfs.config import Config, read_token_file
from tierfs.core.errors import UserError

if TYPE_CHECKING:
    from google.auth.external_account import SupplierContext

SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt"
MAX_RESPONSE = 64 << 10  # an access token answer is ~1-2 KiB
TIMEOUT = (10.0, 30.0)  # connect, read: an endpoint slower than that is an outage


class IdentityRefused(auth.RefreshError):
    """The job's token could not be had, or was refused: the message says what to fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)  # type: ignore[no-untyped-call]  # google-auth leaves its errors' __init__ untyped


class JobCredentials(identity_pool.Credentials):
    """Workload identity federation from a token file; refreshes are serialized and capped.

    Built by :func:`job_credentials`. google-auth makes a copy of this class (same constructor)
    as the source of an impersonation, so nothing here changes the constructor's arguments.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # google-auth's, untyped: passed on as given
        self._refresh_lock = threading.Lock()
        self._transport = CappedRequest()

    def refresh(self, request: auth_transport.Request) -> None:
        """A new access token; ``request`` (the storage session's) is not used: ours caps answers."""
        seen = self.token
        with self._refresh_lock:
            if self.token and self.token != seen:
                return  # another thread refreshed while this one waited: one exchange, not one per thread
            try:
                super().refresh(self._transport)  # type: ignore[no-untyped-call]  # google-auth's, untyped
            except (IdentityRefused, auth.TransportError):
                raise
            except (auth.RefreshError, auth.OAuthError) as e:
                raise IdentityRefused(self._refused(e)) from None
            except (ValueError, TypeError, KeyError, OverflowError) as e:  # a 200 that is no token answer
                raise IdentityRefused(
                    f"{self._step()} answered no usable access token ({type(e).__name__}: {str(e)[:200]})"
                ) from None
            if not self.token or not isinstance(self.token, str):
                raise IdentityRefused(f"{self._step()} answered no access token")

    def grantee(self) -> str:
        """Who needs a role on the bucket, for messages: the impersonated account, else the job's principal."""
        account = self.service_account_email
        if account:
            return f"serviceAccount:{account}"
        return principal(self._audience, self._subject())

    def _subject(self) -> str | None:
        supplier = self._subject_token_supplier
        return supplier.subject if isinstance(supplier, TokenFile) else None

    def _step(self) -> str:
        if self.service_account_email:
            return f"impersonating {self.service_account_email} with the job's token"
        return f"the token exchange at {self._token_url}"

    def _refused(self, e: Exception) -> str:
        """One line: which step refused, why, and what an admin grants so it does not."""
        job = principal(self._audience, self._subject())
        if self.service_account_email and isinstance(e, auth.RefreshError) and len(e.args) > 1:
            # generateAccessToken refused: the exchange before it worked, the impersonation did not.
            return (
                f"impersonating {self.service_account_email} was refused ({_gist(e.args[1])}): grant "
                f"roles/iam.workloadIdentityUser on it to {job}"
            )
        return (
            f"the token exchange at {self._token_url} refused the job's token ({_gist(e)}): check that "
            f"--gcs-token-audience names a workload identity provider that trusts this cluster's tokens, "
            f"and that the token file is fresh"
        )


class TokenFile(identity_pool.SubjectTokenSupplier):
    """The Kubernetes service-account token, read anew for each exchange (kubelet rewrites the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.subject: str | None = None  # the token's ``sub``, for messages (never trusted for anything)

    def get_subject_token(self, context: SupplierContext, request: auth_transport.Request) -> str:
        try:
            token = read_token_file(self.path)
        except UserError as e:
            raise IdentityRefused(str(e)) from None
        self.subject = _jwt_subject(token) or self.subject
        return token


class CappedRequest(auth_transport.Request):
    """google-auth's transport interface over requests, for the token endpoints.

    The answer is read up to :data:`MAX_RESPONSE` bytes; 429 and 5xx are
    :class:`google.auth.exceptions.TransportError` (transient: the caller retries later),
    every other status goes back to google-auth, which makes it a refusal.
    """

    def __init__(self) -> None:
        self._session = requests.Session()

    def __call__(
        self,
        url: str,
        method: str = "GET",
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        **kwargs: object,
    ) -> _Response:
        host = urllib.parse.urlsplit(url).netloc
        try:
            with self._session.request(
                method, url, data=body, headers=headers, timeout=TIMEOUT, stream=True, allow_redirects=False
            ) as response:
                data = response.raw.read(MAX_RESPONSE + 1, decode_content=True)
                status, reply_headers = response.status_code, dict(response.headers)
        except (requests.RequestException, OSError) as e:
            raise _transient(f"{host} cannot be reached: {type(e).__name__}") from e
        if status == 429 or status >= 500:
            raise _transient(f"{host} answered HTTP {status}")
        if len(data) > MAX_RESPONSE:
            raise IdentityRefused(f"{host} answered more than {MAX_RESPONSE >> 10} KiB, not a token")
        return _Response(status, reply_headers, data)


def _transient(message: str) -> auth.TransportError:
    """google-auth's error for a failure that may pass: its caller tries again later."""
    return auth.TransportError(message)  # type: ignore[no-untyped-call]  # google-auth leaves its errors' __init__ untyped


class _Response(auth_transport.Response):
    def __init__(self, status: int, headers: dict[str, str], data: bytes):
        self._status, self._headers, self._data = status, headers, data

    @property
    def status(self) -> int:
        return self._status

    @property
    def headers(self) -> dict[str, str]:
        return self._headers

    @property
    def data(self) -> bytes:
        return self._data


def job_credentials(cfg: Config) -> JobCredentials | None:
    """The job's credentials as ``cfg`` asks (``--gcs-token-file`` and the rest), or None: the node's."""
    if cfg.gcs_token_file is None:
        return None
    impersonate = None
    if cfg.gcs_service_account:
        account = urllib.parse.quote(cfg.gcs_service_account, safe="@.")
        impersonate = f"{cfg.gcs_iam_url.rstrip('/')}/projects/-/serviceAccounts/{account}:generateAccessToken"
    return JobCredentials(
        audience=cfg.gcs_token_audience,
        subject_token_type=JWT_TOKEN_TYPE,
        token_url=cfg.gcs_sts_url,
        subject_token_supplier=TokenFile(cfg.gcs_token_file),
        service_account_impersonation_url=impersonate,
        scopes=[SCOPE],
    )


def principal(audience: str, subject: str | None) -> str:
    """The IAM principal a Kubernetes service account becomes in the pool ``audience`` names.

    GKE's pool (PROJECT.svc.id.goog) maps ``system:serviceaccount:NS:KSA`` to ``ns/NS/sa/KSA``;
    another pool maps the token's ``sub`` as its provider's attribute mapping says, usually as is.
    """
    pool = re.search(r"workloadIdentityPools/([^/]+)", audience)
    gke = re.match(r"identitynamespace:([^:]+\.svc\.id\.goog):", audience)
    if pool:
        project = re.search(r"projects/([^/]+)", audience)
        base = (
            f"principal://iam.googleapis.com/projects/{project[1] if project else 'PROJECT_NUMBER'}"
            f"/locations/global/workloadIdentityPools/{pool[1]}"
        )
        name = pool[1]
    elif gke:
        base = f"principal://iam.googleapis.com/projects/PROJECT_NUMBER/locations/global/workloadIdentityPools/{gke[1]}"
        name = gke[1]
    else:
        return "the job's Kubernetes service account"
    ksa = re.fullmatch(r"system:serviceaccount:([^:/]+):([^:/]+)", subject or "")
    if name.endswith(".svc.id.goog"):
        return f"{base}/subject/ns/{ksa[1]}/sa/{ksa[2]}" if ksa else f"{base}/subject/ns/NAMESPACE/sa/KSA"
    return f"{base}/subject/{subject}" if subject else f"{base}/subject/SUBJECT"


def _jwt_subject(token: str) -> str | None:
    """The ``sub`` claim of a JWT, unverified (only ever shown in messages), or None."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:
        return None
    sub = claims.get("sub") if isinstance(claims, dict) else None
    return sub[:300] if isinstance(sub, str) and sub.isprintable() else None


def _gist(e: object) -> str:
    """One short line of an endpoint's error: ``invalid_grant: ...`` or a JSON error's message."""
    args = getattr(e, "args", None)
    text = e if isinstance(e, str) else (str(args[0]) if args else str(e))
    try:
        body = json.loads(text)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            text = f"HTTP {error.get('code')} {error.get('message', '')}"
        elif error:
            text = f"{error}: {body.get('error_description', '')}"
    except ValueError:
        pass
    text = re.sub(r"^Error code ", "", text)
    return " ".join(text.split())[:300]
