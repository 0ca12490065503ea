"""A body's transfer, written once as steps and run either in a worker thread or on the loop.

A chunk body is the bulk of peer traffic. Moving it through the event loop costs a trio
round per socket segment and a thread hand-off per piece for the hashing and writing: on
two cores that bookkeeping cost as much CPU as the cipher and the copies together. So a body
of more than :data:`INLINE` bytes is moved by one worker thread from its first byte to its
last: blocking ``recv_into``/``send``/``sendfile`` on the connection's socket (``poll`` when
it would block), opening or sealing, hashing and ``pwrite`` in the same loop, with the GIL
released in every one of them. The loop only waits for it. Smaller bodies, and streams
without a socket (tests' memory streams), run the same steps on the loop, where a thread
hand-off would cost more than the body.

What to move is a generator of :class:`Recv`, :class:`Send` and :class:`SendFile` steps; the
driver carries each out in full before resuming the generator, which does everything else
(opening records, feeding the sink) itself, in whichever thread drives it.

Cancellation: the loop shuts the connection down through the thread's own descriptor (still
open even when the loop's was closed meanwhile), which ends a thread blocked on it at once,
waits for the thread (its buffers and descriptors must outlive it) and re-raises. A body cut
short leaves the connection out of step, and every caller closes it then anyway.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from collections.abc import Generator
from dataclasses import dataclass
from typing import NamedTuple

import trio

from tierfs.peers.offload import INLINE, InThread
from tierfs.peers.wire import PIECE, PeerUnavailable, reason, recv_into


class Recv(NamedTuple):
    """Fill ``view`` exactly; the connection ending first is :class:`PeerUnavailable`."""

    view: memoryview


class Send(NamedTuple):
    view: memoryview


@dataclass(frozen=True, slots=True)  # not a NamedTuple: its ``count`` would hide tuple.count
class SendFile:
    """``count`` bytes of ``fd`` from ``offset``; a file that ends first raises ``EOFError``."""

    fd: int
    offset: int
    count: int


Steps = Generator["Recv | Send | SendFile", None, None]


async def run(stream: trio.abc.Stream, steps: Steps, size: int) -> None:
    """Carry out ``steps``, a body of ``size`` bytes, in a worker thread or (small, or no socket) on the loop."""
    stream = getattr(stream, "raw", stream)  # a sealed stream's steps carry records already sealed
    sock = getattr(stream, "socket", None)
    if size <= INLINE or sock is None:
        await _on_loop(stream, steps)
        return
    # The thread's own descriptor of the connection, closed here once the thread has ended:
    # nothing the thread does can close the loop's (whose number could otherwise be reused
    # under it), and the loop can still shut the connection down when its own descriptor was
    # closed meanwhile (a pool dropping its connections).
    own = socket.socket(fileno=os.dup(sock.fileno()))
    try:
        job = InThread(lambda: _blocking(own, steps))
        try:
            await job.wait()
        except trio.Cancelled:
            _interrupt(own)
            await job.settle()
            raise
    finally:
        own.close()
    job.unwrap()


def _interrupt(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected any more: the thread fails on its own


# -- in a worker thread ----------------------------------------------------------------------


def _blocking(sock: socket.socket, steps: Steps) -> None:
    try:
        for step in steps:
            if isinstance(step, Recv):
                _recv_exactly(sock, step.view)
            elif isinstance(step, Send):
                _send_all(sock, step.view)
            else:
                _sendfile(sock, step)
    finally:
        steps.close()  # its own clean-up runs here, in this thread, before the loop goes on


def _wait(sock: socket.socket, event: int) -> None:
    poller = select.poll()
    poller.register(sock, event)
    poller.poll()  # a shut-down socket is readable and writable at once


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        try:
            got = sock.recv_into(view)
        except BlockingIOError:
            _wait(sock, select.POLLIN)
            continue
        except OSError as e:
            raise PeerUnavailable(f"connection lost mid-body: {reason(e)}") from None
        if not got:
            raise PeerUnavailable("connection closed mid-body")
        view = view[got:]


def _send_all(sock: socket.socket, view: memoryview) -> None:
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            _wait(sock, select.POLLOUT)
        except OSError as e:
            raise PeerUnavailable(f"connection lost while sending: {reason(e)}") from None


def _sendfile(sock: socket.socket, step: SendFile) -> None:
    sent = 0
    while sent < step.count:
        try:
            n = os.sendfile(sock.fileno(), step.fd, step.offset + sent, step.count - sent)
        except BlockingIOError:
            _wait(sock, select.POLLOUT)
            continue
        except OSError as e:
            if e.errno in _NO_SENDFILE and sent == 0:
                _copy_file(sock, step)
                return
            raise PeerUnavailable(f"connection lost while sending: {reason(e)}") from None
        if n == 0:
            raise EOFError(f"file ended {step.count - sent} bytes short of the promised body")
        sent += n


_NO_SENDFILE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)  # not a file sendfile can read


def _copy_file(sock: socket.socket, step: SendFile) -> None:
    """``pread`` and send, where ``sendfile`` cannot."""
    buf = bytearray(min(step.count, PIECE))
    view, done = memoryview(buf), 0
    while done < step.count:
        n = os.preadv(step.fd, [view[: min(len(view), step.count - done)]], step.offset + done)
        if not n:
            raise EOFError(f"file ended {step.count - done} bytes short of the promised body")
        _send_all(sock, view[:n])
        done += n


# -- on the loop -------------------------------------------------------------------------------


async def _on_loop(stream: trio.abc.Stream, steps: Steps) -> None:
    moved_anything = False
    try:
        for step in steps:
            if isinstance(step, Recv):
                view = step.view
                while view:
                    view = view[await recv_into(stream, view) :]
            elif isinstance(step, Send):
                await _send_on_loop(stream, step.view)
            else:
                await _sendfile_on_loop(stream, step)
            moved_anything = True
    finally:
        steps.close()
    if not moved_anything:
        await trio.lowlevel.checkpoint()


async def _send_on_loop(stream: trio.abc.SendStream, view: memoryview) -> None:
    try:
        await stream.send_all(view)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        raise PeerUnavailable(f"connection lost while sending: {reason(e)}") from None


async def _sendfile_on_loop(stream: trio.abc.SendStream, step: SendFile) -> None:
    sock = getattr(stream, "socket", None)
    sent = 0
    while sock is not None and sent < step.count:
        try:
            n = os.sendfile(sock.fileno(), step.fd, step.offset + sent, step.count - sent)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        except OSError as e:
            if e.errno in _NO_SENDFILE and sent == 0:
                break
            raise PeerUnavailable(f"connection lost while sending: {reason(e)}") from None
        if n == 0:
            raise EOFError(f"file ended {step.count - sent} bytes short of the promised body")
        sent += n
        await trio.lowlevel.checkpoint()  # a fast reader never blocks us: stay cancellable
    if sent < step.count:  # no socket (tests' memory streams), or sendfile refused
        buf = bytearray(min(PIECE, step.count - sent))
        view = memoryview(buf)
        while sent < step.count:
            n = os.preadv(step.fd, [view[: min(len(view), step.count - sent)]], step.offset + sent)
            if not n:
                raise EOFError(f"file ended {step.count - sent} bytes short of the promised body")
            await _send_on_loop(stream, view[:n])
            sent += n
