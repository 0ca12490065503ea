"""Coordination at scale: a few coordinators instead of every node asking every node, and
broadcast restores where each chunk leaves GCS once.

- :mod:`.view`: the holdings of the whole job and the rules of :mod:`tierfs.cluster`
  (newest complete step, adoption, retention floor), kept up to date by difference;
- :mod:`.coordinators`: who coordinates, reporting, answering, taking over;
- :mod:`.broadcast`: the restore planner and the "wait for a peer to have it" fetch;
- :mod:`.transport`: the one request/answer interface all of it uses;
- :mod:`.sim` and :mod:`.scenarios`: a simulated network and GCS, and whole jobs on them.

Not yet wired into the daemon: it still surveys every peer (tierfs.cluster).
"""
