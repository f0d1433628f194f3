"""Deadline and release now live in bench_longctx.timing, the one timing module; this name stays only
for needle.py, quality.py and e2e.py, which import it and are being edited elsewhere. Delete this
file when their imports read `from bench_longctx.timing import Deadline, release`."""

from bench_longctx.timing import Deadline, release

__all__ = ["Deadline", "release"]
