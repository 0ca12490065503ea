"""The node-to-node peer protocol: replicas of other ranks' steps, held in this node's RAM.

``wire`` frames messages and authenticates connections, ``store`` holds replicas on the
RAM tier, ``server`` serves them to peers and ``client`` talks to one peer. The protocol
is described in docs/peer-protocol.md.
"""

from tierfs.peers.client import PeerClient
from tierfs.peers.server import Timeouts, serve
from tierfs.peers.store import LocalChunks, ReplicaStore
from tierfs.peers.wire import AuthFailed, NoSpace, PeerError, PeerUnavailable, ProtocolError

__all__ = [
    "AuthFailed", "LocalChunks", "NoSpace", "PeerClient", "PeerError", "PeerUnavailable",
    "ProtocolError", "ReplicaStore", "Timeouts", "serve",
]
