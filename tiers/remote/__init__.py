"""The sidecar's wire protocol, its Python client, and the tier that stores cold blocks there.

    wire.py    names, layout descriptors and batch framing (shared with kvstore/service/)
    reader.py  binary bodies read straight into tensors
    client.py  Client: tensors by (namespace, key), and prompt chunks by chain hash (tiers/keys.py), over HTTP
    refusals.py  what a refused call raises (ServiceError and its kinds)
    tier.py    RemoteTier: the store's cold tier in a `kvtier serve` sidecar
"""
