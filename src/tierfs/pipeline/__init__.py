"""A checkpoint's way through the tiers: the survey, the restore choice and plan, the restore, replication."""
