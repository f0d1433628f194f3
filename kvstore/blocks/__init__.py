"""Block placement: where every block of every sequence lives and how it moves between tiers.

    table.py         LayerTable: one (sequence, layer)'s block ids + device maps (slot, tier, summary, H2O)
    registry.py      BlockRegistry: each block's tier, holders and content key
    holders.py       every holding table's device maps kept in step with its block's tier
    placement.py     which window (hot, warm, cold) a position belongs in
    demotion.py      which blocks cool first (H2O demote mode)
    tier_stack.py    TierStack: the tiers a Config describes, their sizes and lifetime
    tierset.py       TierSet: place, cool, move (put-then-delete), promote, gather, drop, free
    from_saved.py    blocks out of an opened context's save into the tier of their position (load, keep)
    append_path.py   AppendPath: the eager write path (fill the tail, place new blocks all or nothing, cool)
"""
