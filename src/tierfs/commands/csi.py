"""``tierfs csi``: the Kubernetes CSI node plugin (ephemeral inline volumes).

``tierfs csi --gc JOB`` instead stops the job's daemon on this node and deletes its RAM
data, once no pod of the job uses it. ``tierfs csi --probe`` asks the plugin at
``--endpoint`` whether it answers (its liveness, as an exec probe: an HTTP sidecar's port
on the host network would keep a rollout's new pod from starting beside the old one).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from tierfs.config import DEFAULT_RAMDISK
from tierfs.core.errors import UserError
from tierfs.core.logs import LOG_FORMATS, JsonFormatter
from tierfs.core.parse import parse_address, parse_duration

DEFAULT_STATE_DIR = "/var/lib/kubelet/plugins/csi.tierfs.dev"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get("TIERFS_CSI_" + name.upper().replace("-", "_"), default)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("csi", help="run the Kubernetes CSI node plugin", description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", default=_env("endpoint"), help="unix:///PATH of the socket kubelet calls")
    p.add_argument("--node-id", default=_env("node-id"), help="this node's name, as kubelet knows it")
    p.add_argument("--node-ip", default=_env("node-ip"), help="address peers reach this node's daemons at")
    p.add_argument(
        "--state-dir",
        default=_env("state-dir", DEFAULT_STATE_DIR),
        help=f"the plugin's records and the daemons' mounts (default {DEFAULT_STATE_DIR})",
    )
    p.add_argument(
        "--ramdisk",
        default=_env("ramdisk", str(DEFAULT_RAMDISK)),
        help=f"the host tmpfs directory holding every job's RAM tier (default {DEFAULT_RAMDISK})",
    )
    p.add_argument("--config", default=_env("config"), help="YAML file of cluster-wide volume attribute defaults")
    p.add_argument(
        "--allow-pod-gcs",
        action="store_true",
        default=(_env("allow-pod-gcs") or "").lower() in ("1", "true", "yes"),
        help="let a volume's `gcs` attribute name its own bucket and prefix (default: only --config's "
        "`gcs`); either way a job backs up under PREFIX/<pod namespace>/",
    )
    p.add_argument("--kube-api", default=_env("kube-api"), help="Kubernetes API URL (default: in-cluster)")
    p.add_argument(
        "--gc-after",
        default=_env("gc-after", "24h"),
        help="delete a job's data once no pod used it on this node this long; 0 never (default 24h)",
    )
    p.add_argument("--gc", metavar="JOB", help="delete JOB's daemon and RAM data on this node now, then exit")
    p.add_argument(
        "--probe",
        action="store_true",
        help="ask the plugin at --endpoint whether it answers (exit 0) or not (exit 1), then exit",
    )
    p.add_argument(
        "--ready",
        action="store_true",
        help="as --probe, and exit 1 also when the plugin answers that it cannot serve new volumes "
        "(its readiness; --probe is its liveness)",
    )
    p.add_argument(
        "--keeper-cgroup",
        default=_env("keeper-cgroup"),
        help="a cgroup (v2 directory, outside the plugin's container) to run each mount's keeper and "
        "daemon in, so that a crash of the plugin's container leaves the mounts served",
    )
    p.add_argument(
        "--volume-calls",
        type=int,
        default=_env("volume-calls", "32"),
        help="volume calls (publish, unpublish, stats) the plugin works on at once; more are refused "
        "with UNAVAILABLE and kubelet retries, so that the liveness probe always has a thread "
        "(default 32)",
    )
    p.add_argument(
        "--event-interval",
        default=_env("event-interval", "15s"),
        help="how often the plugin looks at its daemons to post Kubernetes Events on their pods (default 15s)",
    )
    p.add_argument(
        "--event-backup-lag",
        default=_env("event-backup-lag", "10m"),
        help="how long a job's GCS backup may fail or lag before a TierfsBackupFailing Event on its pods (default 10m)",
    )
    p.add_argument(
        "--metrics",
        default=_env("metrics"),
        metavar="HOST:PORT",
        help="serve Prometheus metrics (the plugin's and every daemon's on the node) at /metrics, "
        "with /healthz and /daemons (default: none)",
    )
    p.add_argument("--log-level", default=_env("log-level", "info"), choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--log-format",
        default=_env("log-format", "text"),
        help="text (the default) or json (one object per line), for the plugin's log and every daemon's; "
        "the plugin relays its daemons' logs to its stdout",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The plugin's modules load grpc, the generated messages, requests and yaml: only this command needs them.
    from tierfs.csi import server  # noqa: PLC0415
    from tierfs.csi.errors import VolumeError  # noqa: PLC0415
    from tierfs.csi.settings import PluginConfig, load_settings  # noqa: PLC0415
    from tierfs.csi.volumes import Volumes  # noqa: PLC0415

    if args.probe or args.ready:
        return probe(args.endpoint, ready=args.ready)
    if args.log_format not in LOG_FORMATS:
        raise UserError(f"invalid --log-format {args.log_format!r}: use text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    cfg = PluginConfig(
        node_id=args.node_id or os.uname().nodename,
        node_ip=args.node_ip,
        state_dir=Path(os.path.abspath(args.state_dir)),
        ramdisk=Path(os.path.abspath(args.ramdisk)),
        config_file=Path(os.path.abspath(args.config)) if args.config else None,
        kube_api=args.kube_api,
        gc_after=parse_duration(args.gc_after, "--gc-after"),
        allow_pod_gcs=args.allow_pod_gcs,
        keeper_cgroup=Path(os.path.abspath(args.keeper_cgroup)) if args.keeper_cgroup else None,
        volume_calls=args.volume_calls,
        event_interval=parse_duration(args.event_interval, "--event-interval"),
        event_backup_lag=parse_duration(args.event_backup_lag, "--event-backup-lag"),
        log_format=args.log_format,
        metrics=parse_address(args.metrics, "--metrics") if args.metrics else None,
    )
    if not 1 <= args.volume_calls <= 1024:
        raise UserError(f"invalid --volume-calls {args.volume_calls}: use 1 to 1024")
    if cfg.event_interval <= 0 or cfg.event_backup_lag < 0:
        raise UserError("--event-interval must be above 0 and --event-backup-lag not below 0")
    load_settings(cfg.config_file)  # a broken file or ceiling is a start-up error, not the first pod's
    if args.gc:
        try:
            Volumes(cfg).remove_job(args.gc)
        except VolumeError as e:
            raise UserError(str(e)) from None
        print(f"tierfs: job {args.gc} removed from node {cfg.node_id}")
        return 0
    if not args.endpoint or not args.node_id:
        raise UserError("csi needs --endpoint unix:///PATH and --node-id NAME")
    server.serve(cfg, args.endpoint)
    return 0


def probe(endpoint: str | None, ready: bool = False, timeout: float = 8.0) -> int:
    """Call the plugin's Probe() once: that it answers is its liveness; with ``ready``, that it
    also says it can serve new volumes is its readiness."""
    # grpc and the generated messages load only for a probe (or the plugin itself).
    import grpc  # noqa: PLC0415

    from tierfs.csi import csi_pb2 as pb  # noqa: PLC0415
    from tierfs.csi.rpc import stub  # noqa: PLC0415

    if not endpoint or not endpoint.startswith("unix://"):
        raise UserError("csi --probe needs --endpoint unix:///PATH")
    with grpc.insecure_channel(endpoint) as channel:
        try:
            answer = stub(channel, "Identity", "Probe")(pb.ProbeRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise UserError(f"the CSI plugin at {endpoint} does not answer: {e.code().name}") from None
    if ready and answer.HasField("ready") and not answer.ready.value:
        raise UserError(f"the CSI plugin at {endpoint} cannot serve new volumes: see its log")
    return 0
