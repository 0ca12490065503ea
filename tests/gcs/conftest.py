"""Fixtures of the GCS tests: the bucket's URL, and the job's secret as backups should have it."""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture
def gcs_url(gcs_bucket) -> str:
    return f"gs://{gcs_bucket}/backups"


@pytest.fixture(autouse=True)
def job_secret(monkeypatch) -> str:
    """Backups as they should be run: with the job's secret, so every manifest and chunk is sealed."""
    secret = secrets.token_hex(32)  # as `tierfs secret` makes them
    monkeypatch.setenv("TIERFS_SECRET", secret)
    return secret
