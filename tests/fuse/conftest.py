"""Every FUSE-level test runs on both data paths: kernel passthrough (tierfs' own FUSE
session) and the daemon (pyfuse3), since the volume's semantics must not depend on which
one the node can offer."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["passthrough", "daemon"], autouse=True)
def data_path(request, monkeypatch) -> str:
    monkeypatch.setenv("TIERFS_DATA_PATH", request.param)
    return request.param
