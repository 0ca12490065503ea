"""Coordination at scale: a few coordinators instead of every node asking every node, and
broadcast restores in which each chunk leaves GCS once.

- :mod:`.view`: the holdings of the whole job and the rules of :mod:`tierfs.cluster`
  (newest complete step, adoption, retention floor), kept up to date by difference;
- :mod:`.coordinators`: who coordinates, reporting, answering, taking over;
- :mod:`.broadcast`: the restore planner and the "wait for a peer to have it" fetch;
- :mod:`.transport`: the one request/answer interface all of it uses;
- :mod:`.sim` and :mod:`.scenarios`: a simulated network and GCS, and whole jobs on them
  (``scripts/bench_scale.py``, docs/benchmarks.md "Scale").

Not wired into the daemon yet: it still surveys every peer (tierfs.cluster). What wiring
it in takes:

- Peer service (peers/server.py): route ``coord_report``, ``coord_decide``, ``coord_pull``
  (to :meth:`.coordinators.Coordination.handle`) and ``await_chunk`` (to the running
  restore's :class:`.broadcast.ChunkBoard`), JSON headers without bodies, after the
  handshake like every request. The handler needs the caller's *listen* address as
  ``source`` (the hello must carry it, checked against ``--peers``), and the two long
  polls (up to 30 and 60 s) must not fall under the per-request timeout. During a whole
  job's start every member long-polls the first coordinator at once: its connection cap
  (256 today) must allow the job's size, or members poll briefly instead.
- A :class:`.transport.Transport` over PeerClient with pooled connections: PeerError,
  OSError and trio.TooSlowError become :class:`.transport.Unreachable`, a refused
  connection :class:`.transport.Refused`.
- Daemon: one :class:`.coordinators.Coordination` per node, ``order`` =
  ``candidates(job, peers + [listen])``, holdings from ``_local_holdings()``,
  ``list_gcs`` = :func:`.coordinators.list_sharded` over a public
  ``GcsStore.list_manifests(prefix)`` (today ``_list_manifests``), ``interval`` =
  ``--survey-interval``, run in the daemon's nursery. ``_plan_restore`` asks
  ``member.decide(rank, twins, wait=--restore-wait)`` instead of ``view.survey`` +
  ``choose`` (the survey stays the fallback when ``step`` is None), reads the manifest's
  holders from ``decision.holders(rank, step)`` instead of ``survey.tiers``, and reports
  again once the step is chosen (the announced step is what late nodes adopt).
  ``retention_floor`` and ``status`` read ``member.summary`` (``floor``, ``newest``).
- Restore: for the chunks of a step no peer holds whole, plan with
  :func:`.broadcast.plan` (needs: ``decision.needing(group, step)`` with this node's
  manifest's chunk list for each; holders: the group's ``decision.holders``), run
  :class:`.broadcast.PlannedFetch` with ``read_peer``/``read_gcs`` adapters over
  ChunkSources (raise Unreachable / SourceFailed instead of returning None), and
  ``dead=decision.down``; Restore._fetch calls it for planned chunks, the prefetch
  follows ``plan.order``, and every chunk the restore writes by another way is
  ``board.arrived(h)``. The peer service must serve ``get_chunk`` for chunks of a step
  still being restored once they are written and verified, and a node with nothing to
  restore calls ``board.set_plan([])``.
"""
