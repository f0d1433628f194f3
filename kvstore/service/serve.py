"""`kvtier serve`: run the sidecar under uvicorn (also `python -m kvstore.service`).

Binding anything but a loopback address requires a token (--token or $KVTIER_TOKEN);
clients then send `Authorization: Bearer <token>`. An empty or whitespace token is refused,
never taken to mean "no token".
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import resource
import sys

from kvstore.service.settings import ServiceSettings, check_token

_RESERVED_FILES = 256  # LMDB, logs, worker threads' files: descriptors kept out of --max-connections
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'4096', '64M', '1.5G', '2GiB' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a byte count like 4096, 512M or 2G, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def fit_open_files(max_connections: int) -> int:
    """Raise this process's soft open-file limit to fit max_connections sockets and _RESERVED_FILES more, as far
    as the hard limit allows; the connection cap that fits (printed to stderr when it is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _RESERVED_FILES
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    fits = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, soft - _RESERVED_FILES)
    if fits < 1:
        raise ValueError(f"the open-file limit ({soft}, ulimit -n) leaves no room for connections")
    if fits < max_connections:
        print(f"kvtier serve: --max-connections lowered to {fits} to fit the open-file limit ({soft}, ulimit -Hn "
              f"{hard})", file=sys.stderr)
    return fits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--data-dir", required=True, help="directory of the LMDB store (created if missing)")
    parser.add_argument("--cpu-bytes", type=parse_bytes, default=parse_bytes("1G"), help="read cache budget")
    parser.add_argument("--ssd-bytes", type=parse_bytes, default=parse_bytes("64G"), help="LMDB budget")
    parser.add_argument("--token", default=os.environ.get("KVTIER_TOKEN"),
                        help="bearer token required on every /v1 and /metrics request (default $KVTIER_TOKEN)")
    parser.add_argument("--compression", choices=("none", "zstd"), default="none",
                        help="zstd level 1 on stored values: less disk, slower puts and cold reads")
    parser.add_argument("--no-sync", action="store_true",
                        help="skip the fsync per LMDB commit: acknowledged puts survive kill -9 but not an OS crash")
    parser.add_argument("--max-value-bytes", type=parse_bytes, default=parse_bytes("256M"))
    parser.add_argument("--max-body-bytes", type=parse_bytes, default=parse_bytes("1G"),
                        help="any request body, JSON or binary; checked while it streams in")
    parser.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="longest wait for a whole request head (then the connection closes) or for the next "
                             "piece of a body (then 408 and the connection closes)")
    parser.add_argument("--max-requests", type=int, default=1024, metavar="N",
                        help="/v1 requests in flight beyond which new ones get a JSON 503 'overloaded' (idle "
                             "connections do not count)")
    parser.add_argument("--max-connections", type=int, default=4096, metavar="N",
                        help="open connections beyond which new ones are closed unanswered (at most the open-file "
                             "limit less 256, which is raised to fit when the hard limit allows)")
    parser.add_argument("--keep-alive", type=float, default=5.0, metavar="SECONDS",
                        help="an idle keep-alive connection is closed after this")
    parser.add_argument("--max-lookup-tokens", type=int, default=1 << 22, metavar="N",
                        help="token ids (or chunk hashes) one prefix lookup may name; more get 413")
    parser.add_argument("--http", choices=("httptools", "h11"), default=None,
                        help="HTTP parser: httptools (C; the default when installed) or h11 (pure Python)")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))


def settings_from(args: argparse.Namespace) -> ServiceSettings:
    return ServiceSettings(
        data_dir=args.data_dir, cpu_bytes=args.cpu_bytes, ssd_bytes=args.ssd_bytes, token=args.token,
        compression=args.compression, sync=not args.no_sync, max_value_bytes=args.max_value_bytes,
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout, max_requests=args.max_requests,
        max_connections=args.max_connections, keep_alive_s=args.keep_alive, max_lookup_tokens=args.max_lookup_tokens,
    )


def run(args: argparse.Namespace) -> int:
    try:
        check_token(args.token)
    except ValueError as exc:
        print(f"kvtier serve: --token / $KVTIER_TOKEN: {exc}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and not args.token:
        print(f"kvtier serve: refusing to bind {args.host!r} without a token; pass --token or set KVTIER_TOKEN "
              "(or bind 127.0.0.1)", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.data_dir, exist_ok=True)
        if not os.access(args.data_dir, os.W_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        print(f"kvtier serve: --data-dir {args.data_dir!r} is not a writable directory ({exc})", file=sys.stderr)
        return 2
    import uvicorn

    from kvstore.service.app import create_app
    from kvstore.service.protocol import http_protocols, with_limits

    try:
        settings = settings_from(args)
        max_connections = fit_open_files(settings.max_connections)
        protocol = with_limits(settings.body_timeout_s, max_connections, args.http or http_protocols()[0])
    except ValueError as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    # No uvicorn limit_concurrency: it counts open connections, and answers past it in text/plain.
    config = uvicorn.Config(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=settings.keep_alive_s, loop="auto",  # uvloop when installed
                            http=protocol)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
