"""Fixtures of a real ``tierfs csi`` process on a real unix socket (:mod:`tierfs_testing.csi`),
called the way kubelet calls it, with a local stand-in for the Kubernetes API.
"""

from __future__ import annotations

import os

import pytest
from tierfs_testing.csi import Mode, Plugin, PodApi, publish_request  # noqa: F401 (for the tests)


@pytest.fixture
def pod_api():
    api = PodApi()
    yield api
    api.close()


@pytest.fixture
def plugin_factory(shm_dir, pod_api):
    """``plugin_factory(*extra_args)`` -> a started plugin; everything stopped and unmounted after."""
    made: list[Plugin] = []

    def make(*extra_args: str) -> Plugin:
        base = shm_dir("tierfs-csi")
        os.chmod(base, 0o755)
        p = Plugin(base, pod_api, extra_args)
        made.append(p)
        p.start()
        return p

    yield make
    for p in made:
        p.cleanup()


@pytest.fixture
def plugin(plugin_factory) -> Plugin:
    return plugin_factory()
