"""A real ``tierfs csi`` process on a real unix socket, called the way kubelet calls it.

kubelet itself cannot run on one machine; the plugin is driven with the same gRPC calls and
the same volume context kubelet sends for an ephemeral inline volume (pod info included).
The Kubernetes API is a small local HTTP server that answers ``GET pod`` with the labels
a JobSet or Indexed Job gives its pods: the one part with no real counterpart on this
machine. Used by the CSI tests and by scripts/bench_csi.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

from tierfs.core import mounts
from tierfs.csi import csi_pb2 as pb
from tierfs.csi.rpc import stub
from tierfs_testing import TIERFS, cleanup_mount, unmount_all_beneath

Mode = pb.VolumeCapability.AccessMode.Mode


class PodApi:
    """Serves ``/api/v1/namespaces/NS/pods/NAME`` from a dict the test fills."""

    def __init__(self):
        self.pods: dict[tuple[str, str], dict] = {}
        self.requests: list[str] = []  # every path asked for, in order
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                api.requests.append(self.path)
                parts = self.path.strip("/").split("/")
                pod = api.pods.get((parts[3], parts[5])) if len(parts) == 6 else None
                body = json.dumps(pod or {"kind": "Status", "code": 404}).encode()
                self.send_response(200 if pod else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, namespace: str, name: str, labels: dict[str, str]) -> None:
        self.pods[(namespace, name)] = {"metadata": {"name": name, "namespace": namespace, "labels": labels}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Plugin:
    base: Path
    api: PodApi
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    channel: grpc.Channel | None = None
    pods: int = field(default=0)
    preexec: Callable[[], object] | None = None  # run in the plugin's process before it starts (a container's cgroup)

    @property
    def socket(self) -> Path:
        return self.base / "csi.sock"

    @property
    def state_dir(self) -> Path:
        return self.base / "state"

    @property
    def ramdisk(self) -> Path:
        return self.base / "ram"

    def args(self, *more: str) -> list[str]:
        return [
            *TIERFS,
            "csi",
            "--node-id",
            "node-a",
            "--node-ip",
            "127.0.0.1",
            "--state-dir",
            str(self.state_dir),
            "--ramdisk",
            str(self.ramdisk),
            "--kube-api",
            self.api.url,
            *self.extra_args,
            *more,
        ]

    def start(self) -> None:
        log = open(self.base / "plugin.log", "a")
        self.proc = subprocess.Popen(
            self.args("--endpoint", f"unix://{self.socket}"), stdout=log, stderr=log, preexec_fn=self.preexec
        )
        log.close()
        # Connect once the plugin listens: a channel that finds no socket backs off for a
        # second before it tries again, which doubled every start.
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"tierfs csi exited ({self.proc.returncode}) before listening: {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tierfs csi did not listen on {self.socket} within 30 s")
            time.sleep(0.01)
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        grpc.channel_ready_future(self.channel).result(timeout=30)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def call(self, service: str, method: str, request):
        return stub(self.channel, service, method)(request, timeout=120)

    def log(self) -> str:
        return (self.base / "plugin.log").read_text()

    # -- what kubelet sends ------------------------------------------------------------

    def new_pod(self, namespace: str = "default", labels: dict[str, str] | None = None) -> dict[str, str]:
        """Pod info kubelet adds to the volume context (and a pod the API knows)."""
        self.pods += 1
        name = f"trainer-{self.pods}-{uuid.uuid4().hex[:5]}"
        self.api.add(namespace, name, labels or {})
        return {
            "csi.storage.k8s.io/pod.name": name,
            "csi.storage.k8s.io/pod.namespace": namespace,
            "csi.storage.k8s.io/pod.uid": str(uuid.uuid4()),
            "csi.storage.k8s.io/serviceAccount.name": "default",
            "csi.storage.k8s.io/ephemeral": "true",
        }

    def target(self) -> str:
        """A path like kubelet's .../pods/<uid>/volumes/kubernetes.io~csi/<name>/mount (not created)."""
        return str(self.base / "pods" / uuid.uuid4().hex / "volumes" / "kubernetes.io~csi" / "ckpt" / "mount")

    def publish(
        self,
        target: str,
        attributes: dict[str, str],
        pod: dict[str, str] | None = None,
        volume_id: str | None = None,
        readonly: bool = False,
        secrets: dict[str, str] | None = None,
        mode: int = Mode.SINGLE_NODE_WRITER,
    ) -> str:
        volume_id = volume_id or f"csi-{uuid.uuid4().hex}"
        self.call(
            "Node",
            "NodePublishVolume",
            publish_request(volume_id, target, {**(pod or self.new_pod()), **attributes}, readonly, secrets, mode),
        )
        return volume_id

    def unpublish(self, volume_id: str, target: str) -> None:
        self.call("Node", "NodeUnpublishVolume", pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target))

    def cleanup(self) -> None:
        """Unmount every target and stop every daemon this plugin started, whatever state it is in."""
        self.stop()
        for record in (self.state_dir / "volumes").glob("*.json") if self.state_dir.exists() else ():
            target = json.loads(record.read_text())["target"]
            while mounts.find_mount(target) is not None:
                subprocess.run(["umount", "-l", target], capture_output=True)
        for staging in (self.state_dir / "mnt").glob("*") if self.state_dir.exists() else ():
            cleanup_mount(staging)
        unmount_all_beneath(self.base)  # targets of records a test removed by hand, ranks' tmpfs


def publish_request(
    volume_id: str,
    target: str,
    context: dict[str, str],
    readonly: bool = False,
    secrets: dict[str, str] | None = None,
    mode: int = Mode.SINGLE_NODE_WRITER,
) -> pb.NodePublishVolumeRequest:
    return pb.NodePublishVolumeRequest(
        volume_id=volume_id,
        target_path=target,
        readonly=readonly,
        volume_context=context,
        secrets=secrets or {},
        volume_capability=pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(), access_mode=pb.VolumeCapability.AccessMode(mode=mode)
        ),
    )
