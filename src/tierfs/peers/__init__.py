"""The node-to-node peer protocol: framing, authentication, and the client of one peer.

``wire`` frames messages and authenticates connections, ``tls`` and then ``sealed``
encrypt them, ``bodies`` moves chunk bodies (with ``transfer`` and ``offload``), ``client``
talks to one peer and ``pool`` keeps its connections; ``network`` is this node's view of
its peers, ``answers`` checks what they answer, ``placement`` picks where replicas go,
``claim`` is the one-node-per-rank check and ``messages`` carries coordination. This
node's side of the protocol, the service that holds and serves replicas, is
:mod:`tierfs.store`. The protocol is described in docs/peer-protocol.md.
"""
