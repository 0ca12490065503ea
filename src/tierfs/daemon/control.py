"""The daemon's control socket: one JSON request per connection, one JSON reply.

Requests: ``status`` (answered by :func:`tierfs.daemon.status.report`), ``commit`` (``tierfs
commit PATH``, answered by :func:`commit`), ``steps`` (``tierfs steps``: every step the job's
tiers hold, :func:`tierfs.daemon.steps.answer`) and ``metrics`` (the daemon's Prometheus series,
which the CSI plugin serves for every daemon of its node); :class:`Answers` routes them. An
asker that leaves early (a timeout) costs its own answer only. Commands and the
CSI plugin ask with :func:`tierfs.core.control_client.request`.

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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

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
    path.unlink(missing_ok=True)  # noqa: ASYNC240 (a socket file on the runtime tmpfs: nothing to wait for)
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
        path.unlink(missing_ok=True)  # noqa: ASYNC240 (as above; and an await here would be cancelled)


async def _one(handler: Handler, stream: trio.SocketStream) -> None:
    async with stream:
        buf = b""
        while not buf.endswith(b"\n") and len(buf) < MAX_REQUEST:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # the asker left
                return
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
        try:
            await stream.send_all(json.dumps(reply).encode() + b"\n")
        except trio.BrokenResourceError:  # the asker gave up waiting (a timeout): its loss, not the daemon's
            log.info("a control request's asker left before its answer")


class Answers:
    """The daemon's answers to the control socket's requests."""

    def __init__(
        self,
        status: Callable[[], dict],
        commit: Callable[[str, int | None], dict],
        metrics: Callable[[], str] = lambda: "",
        steps: Callable[[], Awaitable[dict]] | None = None,
    ):
        self._status, self._commit, self._metrics, self._steps = status, commit, metrics, steps

    async def __call__(self, request: dict) -> dict:
        op = request.get("op")
        if op == "status":
            return self._status()
        if op == "metrics":  # the CSI plugin serves every daemon's series on the node's one endpoint
            return {"text": self._metrics()}
        if op == "commit":
            return self._commit(request["path"], request.get("step"))
        if op == "steps" and self._steps is not None:  # surveys the tiers: seconds, not milliseconds
            return await self._steps()
        raise ValueError(f"unknown request {op!r}")


def commit(steps: Steps, path: str, step: int | None) -> dict:
    """Commit ``path`` (inside the volume) as ``step``, as ``tierfs commit`` asked."""
    if path.startswith("/") or ".." in path.split("/"):
        raise ValueError(f"{path!r} is not a path inside the volume")
    state = steps.commit(path.strip("/"), step)
    if state is None:
        raise ValueError(f"{path} does not exist in the volume")
    return {"step": state.step, "roots": state.roots, "version": state.version}
