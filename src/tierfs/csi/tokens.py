"""The pod's service-account token, handed to its job's daemon as the job's GCS identity.

With ``tokenRequests`` in the CSIDriver object, kubelet puts a token of the pod's Kubernetes
service account in every NodePublishVolume, under :data:`TOKENS`, and with
``requiresRepublish`` calls it again before the token expires. The plugin writes the token
to ``<state>/tokens/<job>.token``, root-only and replaced whole, and gives the daemon that
path (``--gcs-token-file``, never a pod's to choose); the daemon reads it again at each
exchange (:mod:`tierfs.tiers.gcs_identity`). A repeated publish that differs only in its
token is the same publish: it refreshes the file and nothing else.

The value comes from kubelet, but it lands in a root process: it is read with a bound, one
token of at most :data:`MAX_TOKEN` printable ASCII characters.
"""

from __future__ import annotations

import json
from pathlib import Path

from tierfs.core.atomic import write_atomically
from tierfs.csi.errors import InvalidArgument

TOKENS = "csi.storage.k8s.io/serviceAccount.tokens"  # audience -> {token, expirationTimestamp}
MAX_TOKENS_JSON = 64 << 10
MAX_TOKEN = 16 << 10


def pod_token(context: dict[str, str]) -> str | None:
    """The token kubelet passed (one audience: the CSIDriver's), or None without ``tokenRequests``."""
    raw = context.get(TOKENS)
    if not raw:
        return None
    if len(raw) > MAX_TOKENS_JSON:
        raise InvalidArgument(f"{TOKENS} holds more than {MAX_TOKENS_JSON} characters")
    try:
        tokens = json.loads(raw)
        (entry,) = tokens.values()
        token = entry["token"]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise InvalidArgument(
            f"{TOKENS} is not one audience's token: give the CSIDriver exactly one tokenRequests audience"
        ) from None
    if (
        not isinstance(token, str)
        or not 0 < len(token) <= MAX_TOKEN
        or not token.isascii()
        or not token.isprintable()
        or " " in token
    ):
        raise InvalidArgument(f"{TOKENS}: the token is not a service-account token")
    return token


def write_token(path: Path, token: str) -> None:
    """Replace the job's token file whole, root-only (its directory is made 0700)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_atomically(path, token + "\n", 0o600)
