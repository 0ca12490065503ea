"""Fixtures for tests that need a GCS endpoint: a real API server on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.gcs_emulator import GcsEmulator


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """One emulator for the session, with STORAGE_EMULATOR_HOST pointing at it meanwhile."""
    emulator = GcsEmulator(tmp_path_factory.mktemp("gcs-emulator"))
    try:
        emulator.start()
        with pytest.MonkeyPatch.context() as mp:
            for name, value in emulator.environ().items():
                mp.setenv(name, value)
            yield emulator
    finally:
        emulator.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator: GcsEmulator) -> str:
    """A new, empty bucket: tests never see each other's objects."""
    name = f"tierfs-test-{uuid.uuid4().hex[:12]}"
    gcs_emulator.make_bucket(name)
    return name
