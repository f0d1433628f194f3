"""kvtier's Python API: a tiered KV-cache block store for long-context decoding."""

from kvstore.config import Config, ModelSpec
from kvstore.contexts.sequences import PrefixMatch
from kvstore.store import KVStore
from tiers.errors import BlockMissingError, CapacityError, IntegrityError

__all__ = ["BlockMissingError", "CapacityError", "Config", "IntegrityError", "KVStore", "ModelSpec", "PrefixMatch"]
