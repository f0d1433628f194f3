"""Every error kvtier raises on purpose, in one place (kvstore re-exports them)."""

from __future__ import annotations


class IntegrityError(RuntimeError):
    """A stored block failed its checksum: it is never returned as data."""


class CapacityError(RuntimeError):
    """The tiers cannot hold what was asked: the operation was refused and nothing changed."""


class BlockMissingError(KeyError):
    """A tier no longer holds a block it acknowledged (e.g. evicted by a shared cache's own policy)."""
