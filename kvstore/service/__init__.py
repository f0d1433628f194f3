"""The kvtier sidecar: a FastAPI service that holds shared, durable cold tiers (`kvtier serve`).

Submodules: wire (formats shared with kvstore.client), reader (the client's one-copy binary
reads), values (stored value codec), storage (cache + LMDB), metrics, routes, app, cli.
Importing this package imports none of them, so the client stays light.
"""
