"""Decode: one query token attends over a sequence's blocks (select -> stage -> attend -> account).

    eager.py         DecodePath: one layer, any mode and tier (what the step cannot serve); block_table() for all
    eager_step.py    EagerSteps: store.append + store.attend of a decode token through a DecodeStep, eagerly
    staging.py       selected cold blocks fetched in the format their tier holds, into staging rows
    step.py          DecodeStep: the captured step of every layer of a token from device state
    readiness.py     StepReadiness: whether the captured step's next token runs from device state, what it cools
    dense_tables.py  the captured dense step's table bucket and its partition by pool
    cold_slices.py   the captured step's cpu-tier blocks: staged, verified on the GPU
    promotion.py     StepPromotion: cpu blocks the captured step keeps reading move up to warm at block boundaries
    graphs.py        GraphedSteps: one CUDA graph per step key, replayed per token
"""
