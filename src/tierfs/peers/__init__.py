"""The node-to-node peer protocol: framing, authentication, and the client of one peer.

``wire`` frames messages and authenticates connections, ``tls`` encrypts them, ``client``
talks to one peer and ``pool`` keeps its connections; ``network`` is this node's view of
its peers and ``claim`` the one-node-per-rank check. This node's side of the protocol, the
service that holds and serves replicas, is :mod:`tierfs.store`. The protocol is described
in docs/peer-protocol.md.
"""
