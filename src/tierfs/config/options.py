"""Every option of a mount, by flag name, with its help text.

Apart from :mod:`tierfs.config` because these tables are words, not checks: ``tierfs
mount --help``, the mount helper's ``-o`` keys, the ``TIERFS_*`` variables and the CSI
plugin's volume attributes are all read from them, while :class:`tierfs.config.Config`
coerces and checks what they give.
"""

from __future__ import annotations

from tierfs.core.logs import LOG_BACKUPS

# The endpoints the job's GCS identity is exchanged at unless told otherwise (Config's defaults).
DEFAULT_STS_URL = "https://sts.googleapis.com/v1/token"
DEFAULT_IAM_URL = "https://iamcredentials.googleapis.com/v1"

# Every option of a mount (flag name -> help text). Each is a `tierfs mount --FLAG`, a
# ``-o key=value`` of the mount helper, the Config field of the same name with '_' for '-',
# and the environment variable env_name(FLAG); all but host paths and the node's log settings
# are CSI volume attributes (tierfs.csi.settings).
OPTIONS = {
    "ramdisk": "directory on tmpfs that holds the RAM tier (default /dev/shm/tierfs)",
    "job": "job id; all state is scoped by it (default 'default')",
    "rank": "this node's rank in the job (default 0)",
    "nodes": "number of nodes (ranks) in the job (default 1)",
    "capacity": "RAM the volume may use, e.g. 64G (default: what the ramdisk holds)",
    "data-path": "how file bytes travel: passthrough (the kernel reads and writes the RAM tier directly), "
    "daemon (through tierfs), or auto (passthrough where the kernel allows it; the default)",
    "engine": "the FUSE engine: tierfs (its own, on every kernel), pyfuse3 (libfuse; daemon path only), "
    "or auto (tierfs', pyfuse3 where it cannot mount; the default)",
    "wake-cpus": "on (default): while a burst of file creates lasts, keep idle CPUs out of deep idle "
    "states (/dev/cpu_dma_latency), so each answer wakes its caller at once; off: leave them alone",
    "commit-rule": "what commits a checkpoint: 'default', 'none' and/or dir:GLOB, marker:GLOB, file:GLOB, "
    "comma-separated",
    "gcs": "back committed steps up to gs://BUCKET/PREFIX, and restore from it",
    "backup-interval": "back the newest committed step up at most this often, e.g. 30m (default 0: every commit)",
    "keep": "committed steps kept in GCS and on --disk per rank (default 3)",
    "keep-local": "newest committed steps kept in RAM, besides any a tier still needs (default 1)",
    "keep-every": "milestones: every step divisible by this is kept in GCS and on --disk beyond --keep "
    "(default 0: none)",
    "keep-for": "how long a milestone is kept, e.g. 30d (default 0: for good)",
    "prefetch": "chunks a restore fetches at once in the background; 0 fetches only what is read (default 8)",
    "restore-step": "roll the job back: every rank restores this step instead of the newest, and steps newer "
    "than it are set aside (GCS keeps them until discarded); done once, however often given",
    "restore-wait": "at start, wait this long for every peer to answer before choosing the step to restore "
    "(default 15s)",
    "survey-interval": "how often to learn the newest step every rank can restore, which retention follows "
    "(default 30s)",
    "chunk-size": "chunk size for dedup, upload and fetch (default 4M)",
    "gc-grace": "GCS chunks used this recently are never collected (default 10m)",
    "gcs-token-audience": "with --gcs-token-file: the workload identity provider the job's token is exchanged "
    "at, //iam.googleapis.com/projects/NUM/locations/global/workloadIdentityPools/POOL/"
    "providers/P, or GKE's identitynamespace:PROJECT.svc.id.goog:https://container."
    "googleapis.com/v1/projects/P/locations/L/clusters/C",
    "gcs-sts-url": f"with --gcs-token-file: the token exchange (STS) endpoint (default {DEFAULT_STS_URL})",
    "gcs-service-account": "with --gcs-token-file: act as this Google service account (EMAIL), impersonated "
    "with the job's federated token, instead of as the job's principal itself",
    "gcs-iam-url": f"with --gcs-service-account: the IAM credentials endpoint (default {DEFAULT_IAM_URL})",
    "listen": "HOST:PORT where this node's peer service accepts other nodes",
    "peers": "the other nodes' peer services: HOST:PORT,..., patterns like node-{0..15}:7420, "
    "dns:NAME:PORT (a headless Service's addresses) or dns+srv:NAME (SRV records)",
    "replicas": "peers that keep a copy of each committed step (default 1)",
    "erasure": "D+P, e.g. 4+2: instead of replicas, ranks form groups of D+P that keep each other's steps as "
    "erasure-coded parity, P/D of a step's size per node, and survive any P losses per group",
    "secret-file": "file holding the job's peer secret (or set TIERFS_SECRET)",
    "peer-tls": "on (default): peer traffic is TLS 1.3, keyed from the secret or --tls-cert; off: in clear",
    "topology": "this node's labels, e.g. slice=a,rack=r3: replicas and erasure groups spread across them",
    "data-parallel": "data-parallel replicas in the job: ranks nodes/D apart hold identical data (default 1)",
    "coordinator": "HOST[:PORT] of the job's rank-0 coordinator: written to jax-init-info.txt for Orbax/MaxText",
    "mtbf": "the job's mean time between failures, e.g. 6h, for the checkpoint interval tierfs advises "
    "(default: the failures it has seen)",
    "log-level": "debug, info, warning or error (default info)",
    "log-file": "daemon log (default: in the runtime directory, /run/tierfs)",
    "log-format": "text (the default) or json: one object per line, with time, level, job, rank and the event",
    "log-max-size": f"rotate the log past this size, keeping {LOG_BACKUPS} older files (default 64M; 0: never)",
}
# Host directories of `tierfs mount` and of mount -o that a pod author must not choose either
# (so not in OPTIONS); the CSI plugin passes TIERFS_DISK from its own environment to every daemon.
HOST_PATH_OPTIONS = {
    "disk": "local directory (e.g. on NVMe) every committed step is also written to; restores read it "
    "before peers, and when RAM is short committed steps held there leave RAM",
    # Per job, never the plugin's own environment: the CSI plugin writes each job's token and passes its path.
    "gcs-token-file": "file holding the job's Kubernetes service-account token (a JWT, re-read whenever a new "
    "access token is needed): GCS is then reached as the job's identity, exchanged at "
    "--gcs-token-audience, not as the node's",
}
# Addresses on the host: `tierfs mount` options, never a pod's to choose (the CSI plugin
# serves every daemon's metrics on its own endpoint).
HOST_ADDRESS_OPTIONS = {
    "metrics": "HOST:PORT to serve Prometheus metrics at /metrics (default: none; the CSI plugin "
    "serves its daemons' metrics itself)"
}
# Host files for the peer service's TLS: options of `tierfs mount` and of mount -o, but not of
# OPTIONS, which the CSI plugin offers pod authors as volume attributes (no host paths there).
TLS_FILE_OPTIONS = {
    "tls-cert": "PEM certificate this node presents to its peers, instead of one keyed from the secret",
    "tls-key": "PEM private key of --tls-cert",
    "tls-ca": "PEM certificate of the CA that signs every node's --tls-cert",
}
