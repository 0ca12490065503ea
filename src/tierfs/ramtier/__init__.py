"""The RAM tier: this node's real directory tree on tmpfs, and the space it may use."""

from tierfs.ramtier.layout import RankDir
from tierfs.ramtier.space import SpaceAccount

__all__ = ["RankDir", "SpaceAccount"]
