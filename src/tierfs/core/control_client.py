"""The client side of a daemon's control socket: one JSON request, one JSON reply.

The socket itself is served by :mod:`tierfs.daemon.control`. The client lives down here so
that everything that asks a daemon something (the commands, the CSI plugin watching the
daemons it started) can do so without reaching up into the daemon's composition root.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierfs.core.errors import UserError


def request(path: Path, message: Mapping[str, object], timeout: float = 10.0) -> dict[str, Any]:
    """Send one request from a plain blocking process or thread; the reply, or a UserError
    saying why there is none (no daemon there, or the daemon refused)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(os.fspath(path))
            s.sendall(json.dumps(message).encode() + b"\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError as e:
        raise UserError(f"cannot reach the tierfs daemon at {path} ({e.strerror or e}): is it running?") from None
    reply: dict[str, Any] = json.loads(data)  # the daemon's JSON object, for the caller to read
    if "error" in reply:
        raise UserError(f"daemon error: {reply['error']}")
    return reply
