"""The CSI node plugin: tierfs volumes as Kubernetes ephemeral inline volumes.

``identity`` and ``node`` are the two gRPC services kubelet calls; ``volumes`` does the
work (daemons, bind mounts, records) and knows nothing of gRPC, with ``launch`` starting a
daemon and ``records`` keeping the state directory; ``settings`` decides what a volume's
daemon runs with, before any of that work; ``server`` runs them.
"""

DRIVER_NAME = "csi.tierfs.dev"
