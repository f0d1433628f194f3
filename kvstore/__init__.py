"""kvtier's Python API: a tiered KV-cache block store for long-context decoding."""

from kvstore.config import Config, ModelSpec
from kvstore.store import KVStore
from tiers.errors import CapacityError, IntegrityError

__all__ = ["CapacityError", "Config", "IntegrityError", "KVStore", "ModelSpec"]
