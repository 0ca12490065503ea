"""Coordination at scale: a few coordinators instead of every node asking every node, and
broadcast restores in which each chunk leaves GCS once.

- :mod:`.view`: the holdings of the whole job and the rules of :mod:`tierfs.pipeline.survey`
  (newest complete step, adoption, retention floor), kept up to date by difference;
- :mod:`.protocol`: why a few coordinators, their messages, who coordinates (:func:`~.protocol.candidates`);
- :mod:`.coordinator` and :mod:`.reports`: the coordinator side, its rounds, answers and
  the reports it holds; :mod:`.member`: reporting, taking over from a silent coordinator,
  asking for a decision; :mod:`.decision`: an answer as the asker reads it; :mod:`.node`:
  both sides of one node; :mod:`.gcs_listing`: GCS listed in parallel prefix shards;
- :mod:`.broadcast_plan`: the restore planner; :mod:`.broadcast`: the "wait for a peer to
  have it" fetch that follows a plan;
- :mod:`.transport`: the one request/answer interface all of it uses;
- :mod:`.fields`: every field of these messages and answers, checked where it arrives;
- :mod:`.pairs`: the ``[rank, step]`` lists of reports and of peers' ``list`` answers;

It is pure: other nodes are reached only through the :class:`~.transport.Transport` it is
given, so the same code runs in the daemon and on the simulated network and GCS of
:mod:`tierfs_testing.sim` and :mod:`tierfs_testing.scenarios` (``scripts/bench_scale.py``,
docs/benchmarks.md "Scale").

The daemon runs it through :mod:`tierfs.pipeline.coordinating` (reports, decisions, the twins'
shared plan) and :mod:`tierfs.peers.messages` (these messages on peer connections, the
sender's listen address as ``from``); the peer service answers them
(:data:`tierfs.store.server.MESSAGE_OPS`) and serves the chunks of a running restore once
they are written. A node without a peer service, or whose coordinators all fail to
answer, surveys every tier itself (:mod:`tierfs.pipeline.survey`).
"""
