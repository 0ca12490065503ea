"""Every FUSE-level test runs on both data paths and both engines of the daemon path: kernel
passthrough and every byte through the daemon, served by tierfs' own FUSE session (splice,
writer threads, the kernel's writeback cache) and by pyfuse3 (its fallback), since the
volume's semantics must not depend on which one the node can offer."""

from __future__ import annotations

import pytest

# name -> (TIERFS_DATA_PATH, TIERFS_ENGINE)
SERVINGS = {"passthrough": ("passthrough", "auto"), "daemon": ("daemon", "auto"), "pyfuse3": ("daemon", "pyfuse3")}


@pytest.fixture(params=list(SERVINGS), autouse=True)
def data_path(request, monkeypatch) -> str:
    """The data path (``passthrough`` or ``daemon``) the test's volumes are mounted with."""
    path, engine = SERVINGS[request.param]
    monkeypatch.setenv("TIERFS_DATA_PATH", path)
    monkeypatch.setenv("TIERFS_ENGINE", engine)
    return path


@pytest.fixture
def engine(request) -> str:
    """``tierfs`` or ``pyfuse3``: the FUSE engine the test's volumes are served by."""
    return SERVINGS[request.node.callspec.params["data_path"]][1].replace("auto", "tierfs")
