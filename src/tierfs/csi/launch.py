"""How the plugin starts a job's daemon: the ``tierfs mount`` it runs, with what, and for how long.

Apart from :mod:`tierfs.csi.volumes`, which decides when a job's daemon (re)starts, because
this is what the daemon is handed: every option as one ``--key=value`` word (never a flag
of its own), the secret in the environment only, none of the plugin's own ``TIERFS_*``
options passed on, the socket where its keeper offers the mount to the next plugin; and a
start bounded by the restore-wait the ceilings allowed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tierfs.config import OPTIONS, Config, env_name
from tierfs.core import mounts
from tierfs.core.errors import UserError
from tierfs.core.parse import parse_duration
from tierfs.csi.errors import VolumeError
from tierfs.csi.settings import PluginConfig

START_TIMEOUT = 300.0  # seconds `tierfs mount` may take to start, besides its restore-wait


def start_timeout(options: dict[str, str]) -> float:
    """How long `tierfs mount` may take: its start, and the restore-wait the ceilings allowed."""
    wait = options.get("restore-wait")
    try:
        return START_TIMEOUT + (parse_duration(wait) if wait is not None else Config.restore_wait)
    except UserError:
        return START_TIMEOUT + Config.restore_wait


def log_path(cfg: PluginConfig, job: str) -> Path:
    return cfg.state_dir / "logs" / f"{job}.log"


def start_daemon(
    cfg: PluginConfig,
    job: str,
    staging: Path,
    options: dict[str, str],
    *,
    secret: str,
    keeper_socket: Path,
    token: Path | None,
    take_over: bool,
) -> None:
    """Run ``tierfs mount`` of the job at ``staging`` until its daemon serves; VolumeError, in
    one line, if it does not. ``token``: the file of the job's GCS identity (:mod:`tierfs.csi.tokens`);
    ``take_over``: the live mount whose keeper offers it at ``keeper_socket``."""
    args = [
        *cfg.tierfs,
        "mount",
        str(staging),
        "--ramdisk",
        str(cfg.ramdisk),
        "--log-file",
        str(log_path(cfg, job)),
        f"--log-format={cfg.log_format}",
    ]
    args += [f"--{key}={value}" for key, value in sorted(options.items())]  # one word each: never a flag
    if token is not None:
        args.append(f"--gcs-token-file={token}")
    options_env = {env_name(name) for name in (*OPTIONS, "secret")}
    env = {k: v for k, v in os.environ.items() if not (k.startswith("TIERFS_") and env_name(k[7:]) in options_env)}
    if secret:
        env["TIERFS_SECRET"] = secret
    env[mounts.KEEPER_SOCKET] = str(keeper_socket)
    if take_over:
        env[mounts.ADOPT_FROM] = env[mounts.KEEPER_SOCKET]
    if cfg.keeper_cgroup is not None:
        env[mounts.KEEPER_CGROUP] = str(cfg.keeper_cgroup / job)
    timeout = start_timeout(options)
    try:
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise VolumeError(
            f"tierfs for job {job} did not start within {timeout:g}s: see its log, {log_path(cfg, job)}"
        ) from None
    if proc.returncode != 0:
        message = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise VolumeError(f"could not start tierfs for job {job}: {message.removeprefix('tierfs: ')}")
