"""The CSI node plugin and its Kubernetes manifests."""
