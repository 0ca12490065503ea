"""tierfs: a RAM-speed local volume for ML training checkpoints."""

__version__ = "0.1.0"
