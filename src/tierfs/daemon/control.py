"""The daemon's control socket: one JSON request per connection, one JSON reply.

Requests: ``status`` (answered by :func:`tierfs.daemon.status.report`) and ``commit`` (``tierfs
commit PATH``, answered by :func:`commit`); :class:`Answers` routes them.

It lives in the runtime directory, not in the mount, so nothing the volume shows to a
training job is ever a control file it could list, copy or delete by accident. It is
root's alone (0600) from the moment it exists: its mode is set on the socket before
``bind`` creates it, since any user who connects in between could commit or ask.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

import trio

from tierfs.core.atomic import private_dir
from tierfs.core.errors import UserError

if TYPE_CHECKING:
    from tierfs.ramtier.steps import Steps

log = logging.getLogger(__name__)
MAX_REQUEST = 1 << 20
Handler = Callable[[dict], Awaitable[dict]]


async def serve(path: Path, handler: Handler, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve requests on a unix socket at ``path`` (root only) until cancelled."""
    private_dir(path.parent, own=False)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # bind() gives the new socket file the socket's own mode less the umask (0 in the daemon).
    os.fchmod(sock.fileno(), 0o600)
    await sock.bind(os.fspath(path))
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started()
    try:
        await trio.serve_listeners(functools.partial(_one, handler), [listener])
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


async def _one(handler: Handler, stream: trio.SocketStream) -> None:
    async with stream:
        buf = b""
        while not buf.endswith(b"\n") and len(buf) < MAX_REQUEST:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            buf += chunk
        try:
            reply = await handler(json.loads(buf))
        except (ValueError, UserError, OSError) as e:  # refused: the command prints the reason
            log.info("control request refused: %s", e)
            reply = {"error": str(e)}
        except Exception as e:  # a bug; it must still not take the daemon down
            log.exception("control request failed")
            reply = {"error": str(e)}
        await stream.send_all(json.dumps(reply).encode() + b"\n")


class Answers:
    """The daemon's answers to the control socket's requests."""

    def __init__(self, status: Callable[[], dict], commit: Callable[[str, int | None], dict]):
        self._status, self._commit = status, commit

    async def __call__(self, request: dict) -> dict:
        op = request.get("op")
        if op == "status":
            return self._status()
        if op == "commit":
            return self._commit(request["path"], request.get("step"))
        raise ValueError(f"unknown request {op!r}")


def commit(steps: Steps, path: str, step: int | None) -> dict:
    """Commit ``path`` (inside the volume) as ``step``, as ``tierfs commit`` asked."""
    if path.startswith("/") or ".." in path.split("/"):
        raise ValueError(f"{path!r} is not a path inside the volume")
    state = steps.commit(path.strip("/"), step)
    if state is None:
        raise ValueError(f"{path} does not exist in the volume")
    return {"step": state.step, "roots": state.roots, "version": state.version}


def request(path: Path, message: dict, timeout: float = 10.0) -> dict:
    """Send one request from a command-line process (plain blocking socket)."""
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
    reply = json.loads(data)
    if "error" in reply:
        raise UserError(f"daemon error: {reply['error']}")
    return reply
