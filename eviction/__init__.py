"""Which KV blocks a decode step attends, and which ones leave first.

    from eviction import POLICIES, ScoreContext, SeqWindow
    window = SeqWindow(num_tokens=n, block_tokens=16, sink_tokens=64, recent_tokens=1024)  # checked once
    ctx = ScoreContext(summaries, window, q=q, h2o_scores=scores, sketch=codes)
    block_table = POLICIES["topk"]().select(ctx, budget_tokens)  # int64 [kv_heads, k], rows ascending

"topk" is Quest's min/max bound (TopK: fast, the default); "sketch" the 4-bit key sketch selector
(SketchTopK, eviction/sketch_topk.py: finds keys the bound misses, certifies what it left out, slower);
"cascade" ranks Quest's best candidates by their 4-bit codes (CascadeTopK, eviction/cascade.py).
"""

from __future__ import annotations

from eviction.cascade import CascadeTopK
from eviction.policy import Policy, ScoreContext
from eviction.h2o import H2O, h2o_evict
from eviction.select import SeqWindow, select
from eviction.sketch_topk import SketchTopK
from eviction.topk import TopK, topk_select
from eviction.window import Window

POLICIES: dict[str, type[Policy]] = {"window": Window, "h2o": H2O, "topk": TopK, "sketch": SketchTopK,
                                     "cascade": CascadeTopK}

__all__ = [
    "POLICIES",
    "CascadeTopK",
    "H2O",
    "Policy",
    "ScoreContext",
    "SeqWindow",
    "SketchTopK",
    "TopK",
    "Window",
    "h2o_evict",
    "select",
    "topk_select",
]
