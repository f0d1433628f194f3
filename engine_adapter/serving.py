"""Scheduler: continuous batching of many long-context requests over one Decoder and its KVStore.

Each `step()`:
  1. admit   waiting requests, highest priority first then oldest, while the store's room (GPU pools and
             cpu tier: KVStore.free_blocks) holds every running request's whole length (context + all of its
             output: reserved at admission, so a running request never runs out of room) and the batch has
             a place; an admitted request is prefilled (its prompt through the model, or written by `fill`)
             and its first output token comes from that prefill. A preempted request resumes here: its
             saved context is opened and loaded back into the tiers.
  2. preempt when the first waiting request outranks the lowest-priority running one and does not fit:
             that one is saved (store.save: every block, verified when read back) and freed; it resumes,
             in a later step, where it stopped, with the tokens it would have produced had it stayed.
  3. decode  one token of every running request in one Decoder.decode_batch (one captured step for all of
             them on CUDA; in topk, rows that requests join and leave without a new capture); a request that
             reaches max_new_tokens (or eos_id) leaves; its blocks return to the tiers a bounded batch
             before each later token (store.free(..., background=True)), or at once when a waiting
             request needs their room.
A request that could never fit, even in an empty store, is refused at submit (ValueError) and changes nothing.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_adapter.decoder import Decoder
from kvstore.store import KVStore

Fill = Callable[[KVStore, int, int], None]  # (store, seq, num_tokens): write that many tokens' K/V into seq
FILL_TOKEN = 1  # a filled context's last token, decoded in the batch: its logits give the first output


@dataclass
class Request:
    request_id: str
    max_new_tokens: int
    prompt: list[int] = field(default_factory=list)  # token ids prefilled through the model, or:
    context_tokens: int = 0  # a context of this many tokens: `fill` writes all but the last, FILL_TOKEN
    priority: int = 0  # higher runs first and may preempt lower
    arrival_s: float = 0.0  # when it may be admitted, in seconds after the scheduler's start
    output: list[int] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)  # when each output token was known
    admitted_s: float | None = None
    preemptions: int = 0
    seq: int | None = None
    saved_as: str | None = None

    @property
    def length(self) -> int:
        """Tokens the request's sequence holds at its end: its context and every output token but the last."""
        return (len(self.prompt) or self.context_tokens) + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class Scheduler:
    def __init__(self, decoder: Decoder, mode: str = "topk", budget: int = 4096, max_batch: int = 64,
                 fill: Fill | None = None, eos_id: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 on_finish: Callable[[Request], None] | None = None):
        """on_finish: called with each finished request while its sequence still holds every token (a check
        of what was appended, say), before its blocks are freed."""
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.decoder, self.store = decoder, decoder.store
        self.mode, self.budget, self.max_batch, self.fill, self.eos_id = mode, budget, max_batch, fill, eos_id
        self.clock, self.start, self.on_finish = clock, clock(), on_finish
        self.capacity = self.store.free_blocks()  # room when nothing runs: what no request may exceed
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.preemptions = 0
        self._read_from_saves: dict[str, str] = {}  # request id -> its save, still read: deleted when it finishes
        self._warned_hot = False

    def now(self) -> float:
        return self.clock() - self.start

    def submit(self, request: Request) -> None:
        """Queue a request; ValueError (nothing queued) if it is malformed or could never fit."""
        if request.max_new_tokens <= 0:
            raise ValueError(f"{request.request_id}: max_new_tokens must be positive, got {request.max_new_tokens}")
        if bool(request.prompt) == bool(request.context_tokens):
            raise ValueError(f"{request.request_id}: give either a prompt or context_tokens, not both or neither")
        if request.context_tokens and self.fill is None:
            raise ValueError(f"{request.request_id}: context_tokens needs the scheduler's fill")
        ids = {r.request_id for r in self.waiting + self.running + self.finished}
        if request.request_id in ids:
            raise ValueError(f"request id {request.request_id!r} is taken")
        need = self.store.blocks_for(request.length)
        if need > self.capacity:
            raise ValueError(f"{request.request_id}: {request.length} tokens need {need} blocks; the store holds "
                             f"{self.capacity} in the tiers decode reads from (GPU pools and cpu)")
        self.waiting.append(request)

    @property
    def pending(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> dict[str, int]:
        """One round (module docstring); returns the tokens produced, by request id."""
        produced = self._admit()
        self._preempt()
        produced.update(self._decode())
        return produced

    # -- the three parts of a step -----------------------------------------------------------
    def _room(self) -> int:
        """Blocks free beyond what running requests will still add (each reserved its whole length)."""
        growth = sum(self.store.blocks_for(r.length) - self.store.blocks_for(self.decoder.length(r.seq))
                     for r in self.running)
        return self.store.free_blocks() - growth

    def _arrived(self) -> list[Request]:
        now = self.now()
        return sorted((r for r in self.waiting if r.arrival_s <= now), key=lambda r: (-r.priority, r.arrival_s))

    def _admit(self) -> dict[str, int]:
        produced = {}
        for request in self._arrived():
            if len(self.running) >= self.max_batch:
                break
            if self.store.blocks_for(request.length) > self._room() and not self._room_from_freeing(request):
                break  # the first in line waits: later, smaller requests do not overtake it
            self.waiting.remove(request)
            if request.saved_as is not None:
                self._resume(request)
            elif request.prompt:
                produced[request.request_id] = self._prefill(request)
            else:  # its first token comes from the batch's next decode
                request.seq = self.store.create_sequence()
                request.admitted_s = self.now()
                self.fill(self.store, request.seq, request.context_tokens - 1)
            self.running.append(request)
        self._warn_hot_pool()
        return produced

    def _warn_hot_pool(self) -> None:
        """Once: the running requests' sinks, hot windows and tails (at their full lengths) outgrow the hot pool
        (Config.hot_sequences sizes it): new tails would make room by cooling them to the warm format."""
        if self._warned_hot:
            return
        c, store = self.store.config, self.store
        window = -(-c.sink_tokens // c.block_tokens) + -(-c.hot_tokens // c.block_tokens) + 1  # blocks per layer
        need = c.model.num_layers * sum(min(store.blocks_for(r.length) // c.model.num_layers, window)
                                        for r in self.running)
        if need > store.tiers.hot.slots.num_slots:
            self._warned_hot = True
            warnings.warn(f"{len(self.running)} requests run at once, more than the hot pool holds the sinks and "
                          f"hot windows of (Config.hot_sequences={c.hot_sequences}): new tail blocks make room by "
                          "cooling them to the warm format, so a request's tokens may differ from its tokens alone "
                          "(docs/decode.md)", RuntimeWarning, stacklevel=3)

    def _room_from_freeing(self, request: Request) -> bool:
        """Whether `request` fits once the finished requests' blocks still being returned (freed in the background,
        a bounded batch a token) are all back: they are returned now, as admitting it stalls the batch anyway."""
        if not self.store.freeing_blocks():
            return False
        self.store.release_freed(None)
        return self.store.blocks_for(request.length) <= self._room()

    def _prefill(self, request: Request) -> int:
        request.seq = self.store.create_sequence()
        request.admitted_s = self.now()
        return self._emit(request, int(self.decoder.prefill(request.seq, request.prompt).argmax()))

    def _resume(self, request: Request) -> None:
        store = self.store
        request.seq = store.open(request.saved_as)
        store.load(request.seq)  # into the tiers, so the captured step serves it again
        layers = range(store.spec.num_layers)
        if any(store.table(request.seq, layer).num_far for layer in layers):
            self._read_from_saves[request.request_id] = request.saved_as  # blocks the tiers had no room for
        else:
            store.delete_saved(request.saved_as)
        request.saved_as = None

    def _preempt(self) -> None:
        """Save and free the lowest-priority running request when an arrived one outranks it and cannot fit."""
        arrived = self._arrived()
        if not arrived or not self.running:
            return
        first = arrived[0]
        victim = min(self.running, key=lambda r: (r.priority, -(r.admitted_s or 0.0)))
        if (first.priority <= victim.priority or self.store.blocks_for(first.length) <= self._room()
                or self._room_from_freeing(first)):
            return
        name = f"kvtier-preempted-{self.preemptions}"  # a saved context of this store only
        self.store.save(victim.seq, name)
        self.decoder.free(victim.seq)
        if victim.request_id in self._read_from_saves:  # its new save holds every block the old one did
            self.store.delete_saved(self._read_from_saves.pop(victim.request_id))
        victim.seq, victim.saved_as = None, name
        victim.preemptions += 1
        self.preemptions += 1
        self.running.remove(victim)
        self.waiting.append(victim)

    def _decode(self) -> dict[str, int]:
        live = [r for r in self.running if not r.done]
        produced = {}
        if live:
            inputs = [r.output[-1] if r.output else FILL_TOKEN for r in live]
            logits = self.decoder.decode_batch([r.seq for r in live], inputs, self.mode, self.budget, rows=True)
            for request, token in zip(live, logits.argmax(-1).tolist()):
                produced[request.request_id] = self._emit(request, token)
        for request in [r for r in self.running if r.done]:
            if self.on_finish is not None:
                self.on_finish(request)
            self.decoder.free(request.seq, background=True)  # its blocks return a batch per token
            if request.request_id in self._read_from_saves:
                self.store.delete_saved(self._read_from_saves.pop(request.request_id))
            request.seq = None
            self.running.remove(request)
            self.finished.append(request)
        return produced

    def _emit(self, request: Request, token: int) -> int:
        request.output.append(token)
        request.token_s.append(self.now())
        if self.eos_id is not None and token == self.eos_id:
            request.max_new_tokens = len(request.output)  # done: frees its reservation at the end of the step
        return token

    def run(self, idle_sleep_s: float = 0.001) -> list[Request]:
        """Step until every submitted request finished; returns them in the order they finished."""
        while self.pending:
            if not self.step() and not self.running:
                time.sleep(idle_sleep_s)  # nothing has arrived yet
        self.store.release_freed(None)  # the last requests' blocks: nothing decodes now
        return self.finished
