"""KVStore's saved-context methods: save (at once or beside decoding), open (a background load optional), load,
the between-token pumps of background saves and loads, listing and deleting saves.

A mixin of kvstore/store.py's KVStore (the methods are the store's public API; this file only gives them a home
beside the rest of kvstore/contexts/). They use the store's parts: `sequences`, `tiers`, `contexts`, `unread`,
`saves` (BackgroundSaves), `loads` (BackgroundLoads), `saved` (SavedContexts, or None where the cold tier holds
no saves) and its `table` / `token_ids` checks.
"""

from __future__ import annotations

from functools import partial

from kvstore.contexts.background_save import SaveJob
from kvstore.contexts.saving import SavedContexts


class SavedContextMethods:
    def save(self, seq: int, name: str, background: bool = False) -> SaveJob | None:
        """Persist `seq` as `name` beside the cold tier (the ssd tier's LMDB at Config.ssd_path, or Redis at
        Config.redis_url, where full blocks of known token ids are stored once under their content keys, so a
        save there needs Config.model_id: ValueError without): every block from whichever tier holds it, key
        summaries, sketch codes, H2O scores and token ids. Returns once durable; an interrupted save leaves
        nothing under `name` (an earlier save of `name` stays until this one commits, then is replaced).
        background=True: returns a SaveJob at once (done(), wait(timeout), progress) that saves `seq` as it is now
        while tokens decode: pump_saves (engine_adapter.Decoder calls it before every token) copies a bounded part a
        call, a thread writes (kvstore/contexts/background_save.py)."""
        if not isinstance(background, bool):
            raise ValueError(f"background must be True or False, got {background!r}")
        self.table(seq, 0)
        codes = partial(self.unread.codes, seq)  # codes an opened sequence never read go save to save
        if background:
            return self.saves.start(self._saved_contexts(), seq, name, self.sequences[seq], self.token_ids(seq), codes)
        self._saved_contexts().save(name, self.sequences[seq], self.token_ids(seq), codes)
        return None

    def open(self, name: str, background_load: bool = False) -> int:
        """A new sequence on the saved context `name` (saved by any process with this ssd_path or redis_url,
        model_id and geometry): summaries, H2O scores, tables and token ids load now, so a top-K decode can
        start at once; sketch codes load when mode="sketch" first needs them; blocks are read from the
        saved values when selected (or promoted). Sinks, the recent window and the tail load now. Outputs
        equal the saved sequence's. background_load: a thread reads the other blocks meanwhile, newest first,
        and place_loaded (engine_adapter.Decoder calls it before every token) puts them where store.load would:
        once all are in, the captured decode step serves the sequence (kvstore/contexts/background_load.py)."""
        if not isinstance(background_load, bool):
            raise ValueError(f"background_load must be True or False, got {background_load!r}")
        seq = self.contexts.start_saved(self._saved_contexts().load(name))
        if background_load:
            self.loads.start(seq, self.sequences[seq])
        return seq

    def load(self, seq: int, max_blocks: int | None = None) -> int:
        """Move up to `max_blocks` (default: all) of an opened sequence's blocks that are still read from its
        save into the tiers their positions belong in (the hot and warm windows on the GPU, the rest in cpu),
        newest first, into free room only (no other block cools for them; what does not fit stays in the
        save). A sequence whose blocks are all on the GPU or in the cpu tier decodes through the captured step
        (open(name, background_load=True) loads on a thread instead). Returns how many blocks moved (0: nothing
        left to load, or no room)."""
        self.table(seq, 0)
        if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int)
                                       or max_blocks < 0):
            raise ValueError(f"max_blocks must be an int >= 0 or None, got {max_blocks!r}")
        moved, left = 0, float("inf") if max_blocks is None else max_blocks
        for table in self.sequences[seq]:
            if moved >= left:
                break
            moved += self.tiers.load_saved(table, int(min(left - moved, table.num_blocks)))
        return moved

    def place_loaded(self) -> int:
        """Put the blocks that background loads (open(..., background_load=True)) have read since the last call
        into their tiers: between tokens, a bounded pause. Returns how many moved; raises what a read raised
        (IntegrityError, BlockMissingError), once, and that load ends."""
        return self.loads.place()

    def pump_saves(self) -> int:
        """Copy the next part of the background saves (save(..., background=True)) out of the tiers for their
        writers, or commit one whose data is durable: between tokens, at most saves.pump_blocks blocks, rows of
        summaries and sketch codes counted by their bytes (saves.rows_per_block rows a block). Returns how many
        blocks' worth were copied; never raises for a save (its wait() does)."""
        return self.saves.pump()

    def saved_contexts(self) -> list[str]:
        """Names of the contexts saved at this store's ssd_path (or in its Redis)."""
        return self._saved_contexts().names()

    def delete_saved(self, name: str) -> None:
        """Delete a saved context (stores that have it open can no longer read its blocks)."""
        self._saved_contexts().delete(name)

    def _saved_contexts(self) -> SavedContexts:
        if self.saved is None:
            raise ValueError("saved contexts live beside the local ssd tier (Config.ssd_path) or Redis "
                             f"(Config.redis_url); this store's cold tier is {self.tiers.cold.name}")
        return self.saved
