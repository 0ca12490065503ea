"""The plugin's state directory: its layout, its records, and the node's key.

Every call reads and writes records here; a job's own records only under the job's lock,
and the node's key and the count of every job under the node-wide one (:mod:`tierfs.csi.locks`,
:mod:`tierfs.csi.volumes` for the layout). Records are replaced atomically, so a reader
without the lock sees an old record or a new one, or none once another job's call removed it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from tierfs.core import mounts
from tierfs.core.atomic import write_atomically
from tierfs.csi import kube
from tierfs.csi.locks import StateLocks
from tierfs.csi.settings import POD_INFO, POD_NAME, POD_NAMESPACE

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
KEY_BYTES = 32
POD_UID = POD_INFO + "pod.uid"
_UID_CHARS = frozenset("0123456789abcdefABCDEF-")


def read_json(path: Path) -> dict | None:
    """A record, or None when there is none (another job's call may remove one as we list them)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def records(directory: Path) -> list[dict]:
    return [r for p in sorted(directory.glob("*.json")) if (r := read_json(p)) is not None]


def write_json(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data), PRIVATE_FILE)


def alive(path: Path | str) -> bool:
    entry = mounts.find_mount(path)
    return entry is not None and entry.fstype == mounts.FSTYPE and not mounts.is_dead(path)


def pod_of(context: dict[str, str]) -> dict | None:
    """The pod kubelet published a volume for (podInfoOnMount): its namespace, name and uid,
    kept in the volume's record so that the plugin can post Events on the pod later on.

    None when kubelet named no valid pod; a uid that is no UUID is left out (it goes into
    the Events' JSON, never a URL). Records of older plugins have no ``pod``.
    """
    name, namespace, uid = context.get(POD_NAME), context.get(POD_NAMESPACE), context.get(POD_UID, "")
    try:
        kube.check_pod_name(name or "")
        kube.check_namespace(namespace or "")
    except ValueError:
        return None
    pod = {"namespace": namespace, "name": name}
    if uid and len(uid) <= 64 and set(uid) <= _UID_CHARS:
        pod["uid"] = uid
    return pod


class StateDir:
    """Paths and records under the plugin's state directory, made root-only."""

    def __init__(self, state_dir: Path):
        for sub in ("jobs", "volumes", "mnt", "logs", "keepers"):
            (state_dir / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(state_dir / sub, PRIVATE_DIR)  # also when an older plugin made it 0755
        self.state_dir = state_dir
        self.locks = StateLocks(state_dir)
        with self.locks.node():
            self._key = self._node_key()
            self._make_records_private()

    def _node_key(self) -> bytes:
        """The node's random key for request digests, made once (root-only)."""
        path = self.state_dir / "node.key"
        try:
            with open(path, "rb") as f:
                key = bytes.fromhex(f.read(2 * KEY_BYTES + 1).decode("ascii", "replace"))
        except (FileNotFoundError, ValueError):
            key = b""
        if len(key) != KEY_BYTES:
            key = secrets.token_bytes(KEY_BYTES)
            write_atomically(path, key.hex(), PRIVATE_FILE)
        os.chmod(path, PRIVATE_FILE)
        return key

    def _make_records_private(self) -> None:
        """Records an older plugin left: 0600, and no unkeyed digest of a secret in them."""
        for path in [*(self.state_dir / "jobs").iterdir(), *(self.state_dir / "volumes").iterdir()]:
            os.chmod(path, PRIVATE_FILE)
            if path.parent.name == "volumes" and path.suffix == ".json":
                record = read_json(path)
                if record is not None and "fingerprint" in record:
                    del record["fingerprint"]  # kubelet's repeat is then recognised by target alone
                    write_json(path, record)

    # -- paths and records -------------------------------------------------------------

    def _job_path(self, job: str) -> Path:
        return self.state_dir / "jobs" / f"{job}.json"

    def _secret_path(self, job: str) -> Path:
        return self.state_dir / "jobs" / f"{job}.secret"

    def _volume_path(self, volume_id: str) -> Path:
        name = hashlib.sha256(volume_id.encode()).hexdigest()[:32]  # ids are opaque to us
        return self.state_dir / "volumes" / f"{name}.json"

    def _keeper_socket(self, job: str) -> Path:
        """Short whatever the job id: a unix socket's path has at most 107 bytes."""
        return self.state_dir / "keepers" / f"{hashlib.sha256(job.encode()).hexdigest()[:16]}.sock"

    def staging(self, job: str) -> Path:
        return self.state_dir / "mnt" / job

    def volumes(self) -> list[dict]:
        return records(self.state_dir / "volumes")

    def _jobs(self) -> list[dict]:
        return records(self.state_dir / "jobs")

    def _volumes_of(self, job: str) -> list[dict]:
        return [v for v in self.volumes() if v["job"] == job]

    def _touch_job(self, job: str, idle: bool) -> None:
        held = read_json(self._job_path(job))
        if held is not None:
            held["idle_since"] = time.time() if idle else None
            write_json(self._job_path(job), held)
