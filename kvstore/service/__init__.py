"""The kvtier sidecar: a FastAPI service that holds shared, durable cold tiers (`kvtier serve`).

Submodules: values (stored value codec), storage (cache + LMDB), damage (opening a damaged
file read-only) over lmdbfile (a reader of LMDB's format that trusts no byte), verify
(`kvtier verify`), guard (token, requests in flight and body limits before routing), protocol
(request-head deadline, connection cap), metrics, openapi, routes, prefix, lookup (a prefix
lookup's body, bounded and parsed a slice at a time), app, serve (the `kvtier serve` command).
The wire format and the client live in tiers/remote/, below the tier that speaks it.
"""
