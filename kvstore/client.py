"""The public name of the sidecar's Python client; it lives beside the tier that uses it
(tiers/remote/client.py), so tiers never import kvstore."""

from tiers.remote.client import (  # noqa: F401
    AuthError, BadRequestError, Client, CorruptValueError, HeldPrefix, NotFoundError, ServiceError, StorageFullError,
    UnreachableError,
)
from tiers.keys import ChunkKeys  # noqa: F401
