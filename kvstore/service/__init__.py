"""The kvtier sidecar: a FastAPI service that holds shared, durable cold tiers (`kvtier serve`).

Submodules: values (stored value codec), storage (cache + LMDB), metrics, routes, app, cli.
The wire format and the client live in tiers/remote/, below the tier that speaks it.
"""
