"""The pod's service-account token (CSIDriver ``tokenRequests``) becomes its job's GCS identity:
written root-only for the job's daemon, which is started with it, and replaced at each
republish kubelet makes to hand over a fresh one."""

from __future__ import annotations

import json
import os
import stat

import grpc
import pytest

from tests.csi.test_node import JOB, code_of, daemon_pid
from tierfs.csi.tokens import TOKENS

AUDIENCE = {
    "gcs-token-audience": "identitynamespace:example.svc.id.goog:https://container.googleapis.com/v1/"
    "projects/example/locations/here/clusters/c"
}  # the admin's, usually


def tokens(token: str) -> dict[str, str]:
    """What kubelet puts in the volume context: one audience's token."""
    return {
        TOKENS: json.dumps({"example.svc.id.goog": {"token": token, "expirationTimestamp": "2026-11-29T10:00:00Z"}})
    }


def test_the_pods_token_reaches_the_daemon_and_each_republish_refreshes_it(plugin):
    target, pod = plugin.target(), plugin.new_pod()
    vol = plugin.publish(target, {**JOB, **AUDIENCE, **tokens("eyJ.first.token")}, pod=pod)
    path = plugin.state_dir / "tokens" / "llama.token"
    st = os.stat(path)
    assert path.read_text() == "eyJ.first.token\n" and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    cmdline = open(f"/proc/{daemon_pid(plugin, 'llama')}/cmdline", "rb").read().split(b"\0")
    assert f"--gcs-token-file={path}".encode() in cmdline

    pid = daemon_pid(plugin, "llama")
    plugin.publish(target, {**JOB, **AUDIENCE, **tokens("eyJ.second.token")}, pod=pod, volume_id=vol)  # republish
    assert path.read_text() == "eyJ.second.token\n"
    assert daemon_pid(plugin, "llama") == pid, "a fresh token is no new daemon"


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps({}),
        json.dumps({"a": {"token": "x"}, "b": {"token": "y"}}),
        "not json",
        json.dumps({"a": {"token": "two words"}}),
        "x" * (65 << 10),
    ],
)
def test_a_malformed_token_is_refused_in_one_line(plugin, raw):
    code, details = code_of(lambda: plugin.publish(plugin.target(), {**JOB, **AUDIENCE, TOKENS: raw}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and TOKENS in details and "\n" not in details
    assert not (plugin.state_dir / "tokens" / "llama.token").exists()


def test_without_an_audience_the_token_is_not_kept(plugin):
    """kubelet sends tokens wherever the CSIDriver asks for them; a job whose admin set no
    identity provider reaches GCS as before, and no token of it stays on the node."""
    plugin.publish(plugin.target(), {**JOB, **tokens("eyJ.unused")})
    assert not (plugin.state_dir / "tokens").exists()
    cmdline = open(f"/proc/{daemon_pid(plugin, 'llama')}/cmdline", "rb").read()
    assert b"--gcs-token-file" not in cmdline
