"""The FUSE kernel protocol, as ``include/uapi/linux/fuse.h`` defines it (protocol 7.40).

Only what :mod:`tierfs.fs.session` speaks: the opcodes it serves, the INIT flags it
negotiates, the request and reply layouts (little-endian, packed as the kernel's structs,
which are padded to 64 bits), and the ``/dev/fuse`` ioctls that register backing files.
"""

from __future__ import annotations

import struct

KERNEL_MAJOR = 7
KERNEL_MINOR = 40  # 7.40 added passthrough (FUSE_PASSTHROUGH, backing_id, FOPEN_PASSTHROUGH)
ROOT_ID = 1

# -- opcodes -----------------------------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
IOCTL = 39
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
LSEEK = 46
COPY_FILE_RANGE = 47
TMPFILE = 51  # protocol 7.37
STATX = 52  # protocol 7.39: asked for what GETATTR lacks (the birth time)
COPY_FILE_RANGE_64 = 53  # protocol 7.45: its answer takes 64 bits

# -- INIT flags (bits 32..63 travel in flags2) --------------------------------------------
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
DONT_MASK = 1 << 6
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
ASYNC_DIO = 1 << 15
PARALLEL_DIROPS = 1 << 18
POSIX_ACL = 1 << 20
MAX_PAGES = 1 << 22
HANDLE_KILLPRIV_V2 = 1 << 28
INIT_EXT = 1 << 30
DIRECT_IO_ALLOW_MMAP = 1 << 36
PASSTHROUGH = 1 << 37
HAS_RESEND = 1 << 39  # offered by Linux 6.9+: FUSE_NOTIFY_RESEND is understood

# -- notifications (an OUT_HEADER with unique 0 and the code as its error) -----------------
NOTIFY_INVAL_INODE = 2  # the kernel writes back and drops its cached pages of an inode
NOTIFY_RESEND = 7  # every request read but not answered is queued again, marked below
UNIQUE_RESEND = 1 << 63  # set in the unique of a request the kernel sends again

# -- open reply flags ----------------------------------------------------------------------
OPEN_KILL_SUIDGID = 1 << 0  # in an open's open_flags: an O_TRUNC by a caller without CAP_FSETID
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

# -- setattr "valid" bits ------------------------------------------------------------------
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_KILL_SUIDGID = 1 << 11

FSYNC_FDATASYNC = 1 << 0
GETATTR_FH = 1 << 0

# -- layouts ---------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2 (then reserved)
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # ... flags2 max_stack_depth unused[6]
# entry_out: nodeid generation entry_valid attr_valid entry_nsec attr_nsec, then fuse_attr:
# ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink uid gid rdev blksize flags
ENTRY_OUT = struct.Struct("<QQQQIIQQQQQQIIIIIIIIII")
ATTR_OUT = struct.Struct("<QIIQQQQQQIIIIIIIIII")  # attr_valid attr_valid_nsec dummy, fuse_attr
OPEN_IN = struct.Struct("<II")  # flags open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding
MKDIR_IN = struct.Struct("<II")  # mode umask
RENAME_IN = struct.Struct("<Q")  # newdir
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding
LINK_IN = struct.Struct("<Q")  # oldnodeid
GETATTR_IN = struct.Struct("<IIQ")  # getattr_flags dummy fh
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
# valid padding fh size lock_owner atime mtime ctime atimensec mtimensec ctimensec mode unused4 uid gid unused5
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
WRITE_IN = READ_IN  # fh offset size write_flags lock_owner flags padding
WRITE_OUT = struct.Struct("<II")
RELEASE_IN = struct.Struct("<QIIQ")  # fh flags release_flags lock_owner
FLUSH_IN = struct.Struct("<QIIQ")  # fh unused padding lock_owner
FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
SETXATTR_IN = struct.Struct("<II")  # size flags (no FUSE_SETXATTR_EXT)
GETXATTR_IN = struct.Struct("<II")  # size padding
GETXATTR_OUT = struct.Struct("<II")
STATFS_OUT = struct.Struct("<QQQQQIII4x24x")  # blocks bfree bavail files ffree bsize namelen frsize pad spare[6]
DIRENT = struct.Struct("<QQII")  # ino off namelen type
INTERRUPT_IN = struct.Struct("<Q")
FALLOCATE_IN = struct.Struct("<QqqII")  # fh offset length mode padding
LSEEK_IN = struct.Struct("<QqII")  # fh offset whence padding
LSEEK_OUT = struct.Struct("<Q")  # offset
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino offset length (0: to the end)
COPY_FILE_RANGE_IN = struct.Struct("<QQQQQQQ")  # fh_in off_in nodeid_out fh_out off_out len flags
COPY_FILE_RANGE_64_OUT = struct.Struct("<Q")  # bytes copied
# attr_valid attr_valid_nsec flags spare[2], then struct fuse_statx: mask blksize attributes
# nlink uid gid mode ino size blocks attributes_mask, atime btime ctime mtime (sec nsec),
# rdev and dev (major minor), spare
STATX_OUT = struct.Struct("<QII16xIIQIIIH2xQQQQqI4xqI4xqI4xqI4xIIII112x")
STATX_BASIC_STATS = 0x7FF
STATX_BTIME = 0x800
IOCTL_IN = struct.Struct("<QIIQII")  # fh flags cmd arg in_size out_size
IOCTL_OUT = struct.Struct("<iIII")  # result flags in_iovs out_iovs

# -- /dev/fuse ioctls ------------------------------------------------------------------------
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding
BACKING_ID = struct.Struct("<I")


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (229 << 8) | nr


DEV_IOC_BACKING_OPEN = _iow(1, BACKING_MAP.size)
DEV_IOC_BACKING_CLOSE = _iow(2, 4)
