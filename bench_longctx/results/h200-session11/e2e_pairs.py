"""Session 11: `kvtier bench e2e` with the sketch policy reading its first-level channels in adjacent pairs
(SketchTopK(channel_pairs=True) as the store's default "sketch" policy), to compare with the same command on the
default policy in the same call. Measurement wrapper only: arguments are the CLI's.

    PYTHONPATH=. python bench_longctx/results/h200-session11/e2e_pairs.py bench e2e --preset h200 ...
"""

import functools

import eviction
from eviction.sketch_topk import SketchTopK

eviction.POLICIES["sketch"] = functools.partial(SketchTopK, channel_pairs=True)

from kvstore.cli import main  # noqa: E402  (after the policy is set, as a user would set it)

raise SystemExit(main())
