"""gRPC plumbing shared by the services: method tables from the message classes, error codes.

The services are built from ``csi_pb2`` alone (no generated stubs): a method's request
and response classes are found in the service descriptor, so each service is just a
table of plain functions.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import grpc

from tierfs.csi import csi_pb2 as pb
from tierfs.csi.errors import Unavailable, VolumeError

log = logging.getLogger("tierfs.csi")
PACKAGE = "csi.v1"
# gRPC carries the message in a trailer, and trailers are capped (8 KiB by default): an
# answer that quoted a huge attribute back would reach kubelet as a transport error instead.
MAX_DETAILS = 1024


def one_line(text: str, limit: int = MAX_DETAILS) -> str:
    """The message as kubelet shows it in the pod's events: one line, of a bounded length."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Gate:
    """At most ``size`` calls of a service at once; the next one is refused at once, never queued.

    A call queued behind slow ones would sit in the server's thread pool, where the
    Identity service's calls (the liveness probe) must always find a thread free; refused
    (UNAVAILABLE), it is retried by kubelet a moment later instead.
    """

    def __init__(self, size: int, what: str):
        self.size, self.what = size, what
        self._free = threading.BoundedSemaphore(size)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if not self._free.acquire(blocking=False):
            raise Unavailable(
                f"the plugin is working on {self.size} {self.what} at once already, its most "
                "(tierfs csi --volume-calls): kubelet retries"
            )
        try:
            yield
        finally:
            self._free.release()


@contextmanager
def _open() -> Iterator[None]:
    yield


def _message_class(descriptor):
    return getattr(pb, descriptor.name)


def service(
    name: str, methods: dict[str, Callable], gate: Callable[[], AbstractContextManager[None]] = _open
) -> grpc.GenericRpcHandler:
    """A handler for ``csi.v1.<name>``; methods missing from ``methods`` answer UNIMPLEMENTED.

    ``gate``: entered around every call (a :class:`Gate` bounds how many run at once).
    """
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name[name].methods:
        fn = methods.get(method.name)
        if fn is None:
            continue
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _answer(f"{name}.{method.name}", fn, gate),
            request_deserializer=_message_class(method.input_type).FromString,
            response_serializer=_message_class(method.output_type).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(f"{PACKAGE}.{name}", handlers)


# (method, gRPC code name) -> calls answered so: tierfs_plugin_volume_calls_total
CALLS: dict[tuple[str, str], int] = {}
_calls_lock = threading.Lock()


def _answer(name: str, fn: Callable, gate: Callable[[], AbstractContextManager[None]]):
    def call(request, context: grpc.ServicerContext):
        code = "OK"
        try:
            with gate():
                return fn(request)
        except VolumeError as e:
            code, message = e.code, one_line(str(e))
            log.warning("%s: %s %s", name, e.code, message)
            context.abort(grpc.StatusCode[e.code], message)
        except Exception as e:
            code = "INTERNAL"
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, one_line(f"{type(e).__name__}: {e}"))
        finally:
            with _calls_lock:
                CALLS[name, code] = CALLS.get((name, code), 0) + 1

    return call


def stub(channel: grpc.Channel, service_name: str, method: str) -> Callable:
    """A client callable for one method, as kubelet would call it (used by tests and tools)."""
    desc = pb.DESCRIPTOR.services_by_name[service_name].methods_by_name[method]
    return channel.unary_unary(
        f"/{PACKAGE}.{service_name}/{method}",
        request_serializer=_message_class(desc.input_type).SerializeToString,
        response_deserializer=_message_class(desc.output_type).FromString,
    )
