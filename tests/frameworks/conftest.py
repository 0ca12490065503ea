"""Framework tests drive real frameworks (Orbax on JAX's CPU backend) against real clusters."""

from tests.multinode.conftest import cluster  # noqa: F401 (the multi-node fixture, shared)
