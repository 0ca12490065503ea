"""The job's own GCS identity: a real daemon exchanges its Kubernetes token for access tokens.

A stand-in for Google's token exchange (STS) and IAM Credentials runs on 127.0.0.1, a
recording proxy sits in front of the GCS emulator, and the daemon mounts for real with
``--gcs-token-file``: every request to the bucket must carry an access token the stand-in
issued for the token the file held, including after kubelet's refresh rewrites the file.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import threading
import urllib.parse
from pathlib import Path

import pytest
from tierfs_testing.gcs_proxy import GcsProxy

from tests.conftest import tierfs
from tests.gcs.test_backup_restore import wait_backed_up
from tests.helpers import free_port, wait_for, write_orbax_step
from tierfs.config import Config
from tierfs.core.errors import UserError

AUDIENCE = (
    "identitynamespace:proj.svc.id.goog:https://container.googleapis.com/v1/projects/proj/"
    "locations/europe-west4/clusters/train"
)
PRINCIPAL = (
    "principal://iam.googleapis.com/projects/PROJECT_NUMBER/locations/global/workloadIdentityPools/"
    "proj.svc.id.goog/subject/ns/team-a/sa/trainer"
)
ACCOUNT = "ckpt-writer@proj.iam.gserviceaccount.com"
OTHER = "someone-else@proj.iam.gserviceaccount.com"
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
EXPECTED_FORM = {
    "grant_type": "urn:ietf:params:oauth:grant-type:token-exchange",
    "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
    "requested_token_type": "urn:ietf:params:oauth:token-type:access_token",
    "audience": AUDIENCE,
}
IAM_SCOPE = "https://www.googleapis.com/auth/iam"  # what google-auth asks for a token that only impersonates
BEARER = re.compile(r"Bearer ((?:job|sa)-token-\d+)")


def ksa_token(serial: int) -> str:
    """A JWT-shaped Kubernetes service-account token (the stand-in checks no signature)."""

    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    claims = {"sub": "system:serviceaccount:team-a:trainer", "aud": [AUDIENCE], "serial": serial}
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


def write_token(path: Path, token: str) -> None:
    """As the CSI plugin does on kubelet's refresh: a new root-only file renamed over the old."""
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)


class TokenService:
    """Google's STS and IAM Credentials as far as the daemon uses them, on 127.0.0.1.

    ``POST /v1/token`` checks the RFC 8693 form and that the subject token is what the token
    file holds (or, like the real STS, a token of it still unexpired: ``also_valid``), and
    answers ``job-token-N``, valid 2 s. ``POST /v1/projects/-/serviceAccounts/EMAIL:generateAccessToken``
    wants a ``job-token-N`` and answers ``sa-token-N``. ``refuse`` makes the exchange answer that status.
    """

    def __init__(self, token_file: Path):
        self.token_file = token_file
        self.also_valid: set[str] = set()
        self.refuse: int | None = None
        self.exchanges: list[tuple[str, str]] = []  # (subject token, access token issued)
        self.impersonations: list[tuple[str, str, str]] = []  # (account, bearer, token issued)
        self.scopes: dict[str, str] = {}  # access token -> the scope it was asked for
        self.problems: list[str] = []  # requests that were not what the daemon should send
        self._lock = threading.Lock()
        self._serial = 0
        self.port = free_port("127.0.0.1")
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format, *args):  # noqa: A002
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, reply = service.answer(self.path, body, self.headers.get("Authorization"))
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="token-service", daemon=True)
        self._thread.start()

    @property
    def sts_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/token"

    @property
    def iam_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def issued(self) -> set[str]:
        with self._lock:
            return {t for _, t in self.exchanges} | {t for _, _, t in self.impersonations}

    def answer(self, path: str, body: bytes, authorization: str | None) -> tuple[int, dict]:
        with self._lock:
            if path == "/v1/token":
                return self._exchange(urllib.parse.parse_qs(body.decode()))
            account = re.fullmatch(r"/v1/projects/-/serviceAccounts/([^/]+):generateAccessToken", path)
            if account:
                return self._impersonate(urllib.parse.unquote(account[1]), json.loads(body), authorization)
            self.problems.append(f"unexpected POST {path}")
            return 404, {"error": "not_found"}

    def _exchange(self, form: dict[str, list[str]]) -> tuple[int, dict]:
        if self.refuse is not None:
            return self.refuse, {"error": "invalid_grant", "error_description": "the subject token is not trusted"}
        wrong = [k for k, v in EXPECTED_FORM.items() if form.get(k) != [v]]
        scope = (form.get("scope") or [""])[0]
        if scope not in (SCOPE, IAM_SCOPE):
            wrong.append("scope")
        subject = (form.get("subject_token") or [""])[0]
        if subject != self.token_file.read_text() and subject not in self.also_valid:
            wrong.append("subject_token")
        if wrong:
            self.problems.append(f"token exchange with wrong {', '.join(wrong)}: {form}")
            return 400, {"error": "invalid_request", "error_description": f"wrong {', '.join(wrong)}"}
        self._serial += 1
        token = f"job-token-{self._serial}"
        self.exchanges.append((subject, token))
        self.scopes[token] = scope
        return 200, {
            "access_token": token,
            "issued_token_type": EXPECTED_FORM["requested_token_type"],
            "token_type": "Bearer",
            "expires_in": 2,
        }

    def _impersonate(self, account: str, body: dict, authorization: str | None) -> tuple[int, dict]:
        bearer = (authorization or "").removeprefix("Bearer ")
        if account != ACCOUNT:  # the job's principal may impersonate this one account
            return 403, {
                "error": {
                    "code": 403,
                    "message": "Permission 'iam.serviceAccounts.getAccessToken' denied",
                    "status": "PERMISSION_DENIED",
                }
            }
        if self.scopes.get(bearer) != IAM_SCOPE or body.get("scope") != [SCOPE]:
            self.problems.append(f"impersonation of {account} with {authorization!r}, {body}")
            return 403, {
                "error": {
                    "code": 403,
                    "message": "Permission 'iam.serviceAccounts.getAccessToken' denied",
                    "status": "PERMISSION_DENIED",
                }
            }
        self._serial += 1
        token = f"sa-token-{self._serial}"
        self.impersonations.append((account, bearer, token))
        return 200, {"accessToken": token, "expireTime": "2099-01-01T00:00:00Z"}

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def token_file(shm_dir) -> Path:
    path = shm_dir("tierfs-token") / "token"
    write_token(path, ksa_token(1))
    return path


@pytest.fixture
def token_service(token_file):
    service = TokenService(token_file)
    try:
        yield service
    finally:
        service.stop()
    assert not service.problems, service.problems


@pytest.fixture
def proxy(gcs_emulator, monkeypatch):
    """A proxy recording every request's Authorization header; the daemons go through it."""
    with GcsProxy(gcs_emulator.url) as p:
        for name, value in p.environ().items():
            monkeypatch.setenv(name, value)
        yield p


def bearers(proxy: GcsProxy) -> list[str]:
    """The access token of every request so far; fails on one sent without a token the stand-in issued."""
    seen = proxy.authorizations()
    assert seen, "no request reached the bucket"
    tokens = []
    for header in seen:
        match = BEARER.fullmatch(header or "")
        assert match, f"a request went to the bucket with Authorization {header!r}"
        tokens.append(match[1])
    return tokens


def serial(token: str) -> int:
    return int(token.rpartition("-")[2])


def test_every_request_carries_the_jobs_token_and_follows_kubelets_refresh(
    volumes, gcs_url, token_file, token_service, proxy
):
    vol = volumes(
        job="wi",
        capacity="256M",
        gcs=gcs_url,
        gcs_token_file=token_file,
        gcs_token_audience=AUDIENCE,
        gcs_sts_url=token_service.sts_url,
    )
    write_orbax_step(vol.mountpoint, 1, {"a": os.urandom(1 << 20), "b": b"b" * 1000})
    wait_backed_up(vol, 1)
    first = bearers(proxy)
    assert set(first) <= token_service.issued()
    assert {s for s, _ in token_service.exchanges} == {ksa_token(1)}
    assert set(token_service.scopes.values()) == {SCOPE}
    assert len(set(first)) > 1, "tokens valid for 2 s are exchanged again, not used past their expiry"

    # kubelet refreshes the pod's token; the old one stays valid until it expires, as with the real STS.
    before = len(token_service.exchanges)
    token_service.also_valid.add(ksa_token(1))
    write_token(token_file, ksa_token(2))
    write_orbax_step(vol.mountpoint, 2, {"a": os.urandom(1 << 20)})
    wait_backed_up(vol, 2)
    later = token_service.exchanges[before:]
    assert later and later[-1][0] == ksa_token(2), "the exchange after the refresh sends the new token"
    renewed = {t for s, t in later if s == ksa_token(2)}
    tokens = bearers(proxy)
    assert set(tokens) <= token_service.issued()
    assert renewed & set(tokens[len(first) :]), "requests after the refresh carry access tokens of the new token"
    assert max(map(serial, tokens)) in {serial(t) for t in renewed}


@pytest.mark.parametrize("status", [400, 401])
@pytest.mark.expect_log(
    r"gcs: step \d+ delayed, retrying in \d+s: .*token exchange at http://127\.0\.0\.1:\d+"
    r"/v1/token refused the job's token \(invalid_grant"
)
def test_a_refused_exchange_is_one_clear_line_and_the_mount_keeps_serving(
    volumes, gcs_url, token_file, token_service, proxy, monkeypatch, status
):
    # Options from the environment, as a DaemonSet or the plugin passes them.
    monkeypatch.setenv("TIERFS_GCS_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("TIERFS_GCS_TOKEN_AUDIENCE", AUDIENCE)
    monkeypatch.setenv("TIERFS_GCS_STS_URL", token_service.sts_url)
    vol = volumes(job="nogrant", capacity="256M", gcs=gcs_url)
    write_orbax_step(vol.mountpoint, 1, {"a": b"one" * 1000})
    wait_backed_up(vol, 1)

    token_service.refuse = status
    write_orbax_step(vol.mountpoint, 2, {"a": b"two" * 1000})
    lane = wait_for(lambda: (g := vol.status()["gcs"])["state"] == "failing" and g, 30, "the refusal to show in status")
    assert "refused the job's token (invalid_grant: the subject token is not trusted)" in lane["error"]
    assert "--gcs-token-audience" in lane["error"]
    (line,) = [x for x in tierfs("status", vol.mountpoint).stdout.splitlines() if "refused the job" in x]
    assert line.strip().startswith("gcs") and "failing" in line
    # The mount serves on: the committed step reads, new files write.
    assert (vol.mountpoint / "ckpt" / "2" / "a").read_bytes() == b"two" * 1000
    (vol.mountpoint / "scratch").write_bytes(b"still here")
    assert (vol.mountpoint / "scratch").read_bytes() == b"still here"
    assert all(BEARER.fullmatch(h or "") for h in proxy.authorizations()), "never anonymous, even refused"

    token_service.refuse = None
    wait_backed_up(vol, 2, timeout=60)
    assert vol.status()["gcs"]["state"] == "ok"


def test_impersonating_a_service_account(volumes, gcs_url, token_file, token_service, proxy):
    vol = volumes(
        job="imp",
        capacity="256M",
        gcs=gcs_url,
        gcs_token_file=token_file,
        gcs_token_audience=AUDIENCE,
        gcs_sts_url=token_service.sts_url,
        gcs_service_account=ACCOUNT,
        gcs_iam_url=token_service.iam_url,
    )
    write_orbax_step(vol.mountpoint, 1, {"a": b"x" * 5000})
    wait_backed_up(vol, 1)
    tokens = set(bearers(proxy))
    assert tokens and all(t.startswith("sa-token-") for t in tokens), tokens
    assert tokens <= {t for _, _, t in token_service.impersonations}
    assert {a for a, _, _ in token_service.impersonations} == {ACCOUNT}
    assert set(token_service.scopes.values()) == {IAM_SCOPE}, "the job's own token only impersonates"


@pytest.mark.expect_log(r"cannot \w+ gs://\S+: impersonating someone-else@proj\.iam\.gserviceaccount\.com was refused")
def test_a_refused_impersonation_names_the_grant(volumes, gcs_url, token_file, token_service, proxy, shm_dir):
    proc = tierfs(
        "mount",
        shm_dir("tierfs-mnt"),
        "--ramdisk",
        shm_dir("tierfs-ram"),
        "--gcs",
        gcs_url,
        "--gcs-token-file",
        token_file,
        "--gcs-token-audience",
        AUDIENCE,
        "--gcs-sts-url",
        token_service.sts_url,
        "--gcs-service-account",
        OTHER,
        "--gcs-iam-url",
        token_service.iam_url,
        check=False,
    )
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()
    assert f"impersonating {OTHER} was refused (HTTP 403 Permission" in line
    assert f"grant roles/iam.workloadIdentityUser on it to {PRINCIPAL}" in line


def test_options_are_checked_with_one_line_each(token_file, shm_dir, tmp_path):
    base = {
        "mountpoint": "/mnt/x",
        "gcs": "gs://bucket/p",
        "gcs_token_file": str(token_file),
        "gcs_token_audience": AUDIENCE,
    }
    cfg = Config.build(**base)
    assert cfg.gcs_sts_url == "https://sts.googleapis.com/v1/token" and cfg.gcs_service_account is None
    link = token_file.with_name("link")
    link.symlink_to(token_file)
    big = token_file.with_name("big")
    big.write_text("x" * (65 << 10))
    open_to_all = token_file.with_name("open")
    open_to_all.write_text(ksa_token(1))
    open_to_all.chmod(0o666)
    cases = {
        "symbolic link": {"gcs_token_file": str(link)},
        "larger than 64 KiB": {"gcs_token_file": str(big)},
        "writable by group or others": {"gcs_token_file": str(open_to_all)},
        "No such file": {"gcs_token_file": str(tmp_path / "absent")},
        "not a regular file": {"gcs_token_file": str(tmp_path)},
        "needs --gcs-token-audience": {"gcs_token_audience": None},
        "invalid --gcs-token-audience": {"gcs_token_audience": "sts.googleapis.com"},
        "invalid --gcs-sts-url": {"gcs_sts_url": "http://sts.example.com/v1/token"},
        "invalid --gcs-iam-url": {"gcs_iam_url": "ftp://x\nsecond line"},
        "invalid --gcs-service-account": {"gcs_service_account": "not an email"},
        "--gcs-service-account needs --gcs-token-file": {
            "gcs_token_file": None,
            "gcs_token_audience": None,
            "gcs_service_account": ACCOUNT,
        },
    }
    for expected, change in cases.items():
        with pytest.raises(UserError) as err:
            Config.build(**{**base, **change})
        assert expected in str(err.value) and "\n" not in str(err.value), (expected, str(err.value))
