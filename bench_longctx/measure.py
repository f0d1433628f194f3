"""Re-exports Deadline and release from bench_longctx.timing (the one timing module) for quality.py, which
imports them from here."""

from bench_longctx.timing import Deadline, release

__all__ = ["Deadline", "release"]
