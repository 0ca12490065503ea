"""The FUSE face of the volume: a passthrough onto the RAM tier's tree."""

from tierfs.fs.operations import Operations

__all__ = ["Operations"]
