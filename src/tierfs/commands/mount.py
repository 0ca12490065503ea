"""``tierfs mount``: start a daemon for a mountpoint and return once the mount answers.

Also serves fuse3's mount helper form, ``tierfs JOB MOUNTPOINT -o key=value,...``, which
``mount -t fuse.tierfs`` and ``/etc/fstab`` lines run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

from tierfs.config import (
    HOST_ADDRESS_OPTIONS,
    HOST_PATH_OPTIONS,
    OPTIONS,
    TLS_FILE_OPTIONS,
    Config,
    env_name,
    env_value,
)
from tierfs.core import logs, mounts
from tierfs.core.errors import UserError
from tierfs.daemon import keeper
from tierfs.peers import tls

_FLAGS = {**OPTIONS, **HOST_PATH_OPTIONS, **HOST_ADDRESS_OPTIONS, **TLS_FILE_OPTIONS}
# Generic mount(8) options that mean nothing to a FUSE daemon, passed by mount.fuse3.
_IGNORED_MOUNT_OPTIONS = {
    "rw",
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "nofail",
    "_netdev",
    "dev",
    "nodev",
    "suid",
    "nosuid",
    "exec",
    "noexec",
    "async",
    "atime",
    "noatime",
    "relatime",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mount", help="mount a tierfs volume", description=__doc__.splitlines()[0])
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    for name, text in _FLAGS.items():
        p.add_argument(f"--{name}", default=env_value(name), help=f"{text}; env {env_name(name)}")
    p.add_argument(
        "--foreground",
        action="store_true",
        default=(env_value("foreground") or "").lower() in ("1", "true", "yes"),
        help="run the daemon in this process instead of returning once mounted",
    )
    p.add_argument(
        "--read-only",
        action="store_true",
        default=(env_value("read_only") or "").lower() in ("1", "true", "yes"),
        help="mount read-only",
    )
    p.add_argument(
        "--start-fresh",
        action="store_true",
        default=(env_value("start_fresh") or "").lower() in ("1", "true", "yes"),
        help="start even if the tiers hold a newer step complete for every rank than the one the "
        "coordinators chose (by default such a start is refused); env TIERFS_START_FRESH",
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> Config:
    values = {name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name in _FLAGS}
    return Config.build(
        mountpoint=args.mountpoint,
        foreground=args.foreground,
        read_only=args.read_only,
        start_fresh=args.start_fresh,
        secret=env_value("secret"),
        **values,
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.foreground:
        return keep(cfg)
    return spawn(cfg)


def keep(cfg: Config, ready_fd: int | None = None, fuse_fd: int | None = None) -> int:
    """Be the mount's keeper in this process (:mod:`tierfs.daemon.keeper`): it runs the daemon.
    ``fuse_fd``: a live connection taken from another keeper."""
    from tierfs.daemon import host, process  # noqa: PLC0415 (slow imports, for the daemon only)

    host.setup_logging(cfg, rotate=False)  # the daemon rotates the log; its keeper follows
    if cgroup := os.environ.get(keeper.CGROUP_ENV):
        keeper.join_cgroup(cgroup)
    if fuse_fd is None:
        fuse_fd = keeper.inherited_connection()
    watch = os.environ.pop(keeper.WATCH_ENV, None)
    code = keeper.Keeper(
        cfg,
        process.run,
        fuse_fd,
        offer_at=os.environ.get(keeper.SOCKET_ENV),
        watch=int(watch) if watch and watch.isdigit() else None,
    ).run(ready_fd)
    return 0 if code == keeper.HANDED_OVER else code


def run_helper(argv: list[str]) -> int:
    """``tierfs JOB MOUNTPOINT [-o opts]``: the form mount.fuse3 runs."""
    positional, options = [], []
    it = iter(argv)
    for a in it:
        if a == "-o":
            options.extend(next(it, "").split(","))
        elif a.startswith("-o"):
            options.extend(a[2:].split(","))
        elif a.startswith("-"):
            raise UserError(f"unknown mount flag {a!r}: pass tierfs options as -o key=value")
        else:
            positional.append(a)
    if len(positional) != 2:
        raise UserError("usage: tierfs JOB MOUNTPOINT [-o rank=N,ramdisk=DIR,...]")
    values: dict[str, str | None] = {"job": positional[0]}
    switches = {"ro": False, "start-fresh": (env_value("start_fresh") or "").lower() in ("1", "true", "yes")}
    for opt in filter(None, options):
        key, _, value = opt.partition("=")
        key = key.replace("_", "-")
        if key in _FLAGS:
            values[key.replace("-", "_")] = value
        elif key in switches and not value:
            switches[key] = True
        elif key in _IGNORED_MOUNT_OPTIONS or key.startswith("x-"):
            continue
        else:
            raise UserError(f"unknown mount option {opt!r}: known are {', '.join(sorted(_FLAGS))}, ro, start-fresh")
    for name in _FLAGS:  # environment fills what -o leaves out, as for the flags
        values.setdefault(name.replace("-", "_"), env_value(name))
    return spawn(
        Config.build(
            mountpoint=positional[1],
            read_only=switches["ro"],
            start_fresh=switches["start-fresh"],
            secret=env_value("secret"),
            **values,
        )
    )


def spawn(cfg: Config) -> int:
    """Run the daemon in a detached child; wait until it reports the mount ready or failed.

    The child is forked, not executed anew: it inherits the interpreter and the modules
    already imported, which is a good part of the time a restored step takes to appear.
    """
    if os.environ.get(keeper.FD_ENV):  # a keeper executed anew by an upgrade: the mount is live
        return keep(cfg)
    fuse_fd = None
    if adopt_from := os.environ.pop(keeper.ADOPT_ENV, None):  # a live mount, another keeper's
        try:
            fuse_fd = keeper.adopt(adopt_from)
        except OSError as e:
            raise UserError(
                f"cannot take {cfg.mountpoint} over from the keeper at {adopt_from}: {e.strerror or e}"
            ) from None
    else:
        mounts.prepare_mountpoint(cfg.mountpoint)  # fail fast, before any process starts
    # The child inherits both: the TLS contexts (built once; this also refuses TLS files that
    # hold no certificate and key) and the daemon's modules. Stretching the secret (scrypt,
    # ~50 ms) releases the GIL, so it runs while the modules are imported.
    with ThreadPoolExecutor(max_workers=1) as pool:
        keyed = pool.submit(tls.for_config, cfg)
        from tierfs.daemon import process  # noqa: F401, PLC0415 (the CLI's other commands do not need it)

        keyed.result()
    reg = mounts.Registration(cfg.mountpoint)
    log_path = cfg.log_file or reg.log_path
    if cfg.log_file is None:
        reg.prepare()  # the runtime directory: root-only, checked
    else:
        os.makedirs(log_path.parent, 0o700, exist_ok=True)
    # Root's log names paths, peers and errors of every job on the node: root's alone.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _run_detached(cfg, log_fd, write_fd, fuse_fd, log_path)  # never returns
    os.close(log_fd)
    os.close(write_fd)
    if fuse_fd is not None:
        os.close(fuse_fd)
    with os.fdopen(read_fd, "rb") as ready:
        message, *warnings = ready.read().decode().strip().splitlines() or [""]
    if message == "ok":
        for warning in warnings:
            print(f"tierfs: {warning}", file=sys.stderr)
        # A restore may be running already: tearing down this interpreter's modules would
        # take a core from it for tens of milliseconds, for nothing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    if message.startswith("error: "):
        raise UserError(message[len("error: ") :])
    raise UserError(f"the tierfs daemon exited before mounting {cfg.mountpoint}: see {log_path}")


def _run_detached(cfg: Config, log_fd: int, ready_fd: int, fuse_fd: int | None, log_path: Path) -> NoReturn:
    """The keeper's side of the fork: its own session, output to the log, exit without unwinding the CLI."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null)
        os.close(log_fd)
        code = keep(cfg, ready_fd, fuse_fd)
    except UserError as e:  # after the mount was ready: the log is the only place left to say it
        logs.follow(log_path)  # the newest file, should the daemon have rotated it
        print(f"tierfs: {e}", file=sys.stderr)
    except BaseException:  # noqa: BLE001 (a bug: its traceback, in the log)
        logs.follow(log_path)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
