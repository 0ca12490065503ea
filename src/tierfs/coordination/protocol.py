"""A few coordinators per job collect every node's holdings and answer for the whole job.

Why. In a survey (:mod:`tierfs.pipeline.survey`, still the fallback) every node asks every
other node what it holds, at start and every ``--survey-interval``: N(N-1) connections a
round, 10^8 at 10,000 nodes, and N listings of GCS. Here each node sends one report to
each of ``k`` coordinators a round (k = 3: 3N requests in all), the coordinators list GCS
(k listings), and a starting node asks one coordinator for its step. The coordinators
apply the survey's rules (see :mod:`tierfs.coordination.view`) to what they received, so
the answer is the one a survey of every node would give.

This module holds what both sides of the protocol must agree on: the order in which
members become coordinators (:func:`candidates`), the messages, and the bounds and
timings both use. The sides themselves: :mod:`.member` (reporting, skipping a silent
coordinator, asking for a decision), :mod:`.coordinator` (who coordinates, rounds,
answers), :mod:`.decision` (an answer as the asker reads it), :mod:`.node` (both sides of
one node behind one handler).

Agreement. Nodes ask the coordinators in the same order, so they take the same one's
answer; every coordinator receives every report, so they agree unless a message was lost,
and a pull repairs that. A node whose view differs still adopts the step its peers
already run from.

Messages (JSON headers on the peer wire, no bodies; each well under 1 MiB)::

    {"op":"coord_report","report":REPORT,"suspects":[address,...]}        (suspects: <= 8, optional)
        -> {"ok":true,"summary":SUMMARY,"down":[address,...]}
    {"op":"coord_decide","rank":R,"group":[R,...],"wait":SECONDS,"q":ID,"report":REPORT}
            (group: the ranks holding the same data, <= 64; q: the question, the same in
             every poll of it (<= 64 characters); report: the asker's holdings)
        -> {"ok":true,"ready":bool,"you":bool,"coordinating":bool,"summary":SUMMARY,
            "reported":n,"members":m,"down":[address,...],"down_count":d,"silent":[address,...],
            "gcs":{"listed":bool,"error":str|null},
            "ranks":{"R":{"choice":S|null,"steps":{"S":[holder,...]},"nodes":[address,...]}}}
    {"op":"coord_pull"}                                      (a coordinator to a member)
        -> {"ok":true,"report":REPORT}

REPORT is :class:`tierfs.coordination.view.Holdings` on the wire; SUMMARY is
``{"newest":S|null,"floor":S|null,"decisions":[S,...],"complete":[S,...],"ranks":n}``
(the newest complete step, the retention floor, the steps nodes run from). A holder is a
node's address or ``"gcs"``; ``nodes`` are the addresses reporting as that rank (or found
down since). ``coord_decide`` answers as soon as the view is ready, or after ``wait``
seconds (at most 30) with what it has; a stand-in answers at once (``coordinating``
false) and the member asks the next candidate. Answers list at most 16 steps per rank
(the newest), 16 holders per step, 64 down members and, while not ready, 64 silent ones;
``choice`` is computed over everything, so it is exact where the lists are cut. Errors are ``{"error": one line}``.
Every field of a message or an answer is checked where it arrives (:mod:`.fields`): a
member that holds the job's secret is trusted to authenticate, not to tell the truth.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

K = 3  # coordinators per job
RPC_TIMEOUT = 1.0  # a coordination answer is a few hundred bytes: a live node sends it in milliseconds
INTERVAL = 30.0  # between reports (--survey-interval)
TICK = 0.5  # a coordinator's duties (pulls, expiry, listings) run this often
DECIDE_POLL = 2.0  # one long poll of coord_decide
MAX_WAIT = 30.0
MAX_GROUP = 64
MAX_LISTED_STEPS = 16  # per rank in an answer: the newest
MAX_LISTED_HOLDERS = 16  # per step in an answer
MAX_LISTED_DOWN = 64
MAX_SUSPECTS = 8  # coordinators a member found unresponsive, named in its next report

Clock = Callable[[], float]


def candidates(job: str, members: Iterable[str]) -> list[str]:
    """The order in which members become coordinators: the same on every node of ``job``.

    Computed once per node (it hashes every member); pass it on as ``order``.
    """
    return sorted(set(members), key=lambda a: hashlib.blake2b(f"{job}|{a}".encode(), digest_size=8).digest())
