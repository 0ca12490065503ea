"""Holes: where a file's bytes are, so that a sparse file costs what it holds.

On tmpfs a file's size is only a number: ``truncate -s 1P`` takes no RAM, and neither does
a placeholder a restore has not filled yet. Whatever reads or copies whole files as root
(hashing a committed step, copying a snapshot's file) asks the file where its data is
(``SEEK_DATA``/``SEEK_HOLE``) and skips the rest: reading the holes would cost time in
proportion to a size anyone can set, and copying them would fill the RAM with zeros.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

# A file system that cannot tell where the holes are says so with these: its whole file is data.
_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE)


def data_extents(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The ``(offset, end)`` ranges of ``[start, end)`` in the open file ``fd`` that hold data, in order.

    Everything between them is a hole and reads as zeros. Ranges are asked for one at a
    time, as the caller moves on, so a file with a million extents costs no list of them.
    """
    offset = start
    while offset < end:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data from offset to the end of the file
                return
            if e.errno in _UNSUPPORTED:
                yield offset, end
                return
            raise
        if data >= end:
            return
        yield data, min(hole, end)
        offset = hole


def copy_data(src: int, dst: int, size: int) -> None:
    """Make the new, empty file ``dst`` a copy of the first ``size`` bytes of ``src``, holes kept as holes.

    ``copy_file_range`` on tmpfs writes a hole out as pages of zeros, so only the data
    extents are copied, and the size is set last (no larger than ``src`` is by then: a
    source that shrank meanwhile gives a copy that ends where it does, as a plain copy would).
    """
    for start, end in data_extents(src, 0, size):
        offset = start
        while offset < end:
            copied = os.copy_file_range(src, dst, min(end - offset, 1 << 30), offset, offset)
            if copied == 0:
                break  # the source is shorter than it was: what is there is copied
            offset += copied
    os.ftruncate(dst, min(size, os.fstat(src).st_size))
