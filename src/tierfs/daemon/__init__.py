"""The mount daemon: its composition root (:mod:`tierfs.daemon.daemon`), which builds and wires
the parts, and what lives beside it: the keeper and the process it runs, start-up checks, the
cluster's tasks, and the answers on the control socket (status, commit, steps, metrics)."""
