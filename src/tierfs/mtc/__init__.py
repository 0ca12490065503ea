"""GKE Multi-Tier Checkpointing's file protocol, and the daemon's part in it."""
