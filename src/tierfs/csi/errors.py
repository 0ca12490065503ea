"""The CSI spec's status codes as exceptions: the plugin's answers to kubelet.

Both the checks of what a volume asks for and the work of publishing it refuse with
these, and the gRPC layer turns them into status codes; they sit apart so that neither the
checks nor the work needs the other, and none of them needs gRPC.
"""


class VolumeError(Exception):
    """An answer to the caller: ``code`` is the gRPC status name the CSI spec prescribes."""

    code = "INTERNAL"


class InvalidArgument(VolumeError):
    code = "INVALID_ARGUMENT"


class NotFound(VolumeError):
    code = "NOT_FOUND"


class AlreadyExists(VolumeError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(VolumeError):
    code = "FAILED_PRECONDITION"


class Aborted(VolumeError):
    """Another call is working on the same job: kubelet retries (the CSI spec's "operation pending")."""

    code = "ABORTED"


class Unavailable(VolumeError):
    """The plugin works on as many volume calls as it may: kubelet retries, the probe is not held up."""

    code = "UNAVAILABLE"
