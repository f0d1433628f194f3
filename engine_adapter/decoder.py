"""Decoder: a Llama (engine_adapter/llama.py) run against a KVStore.

A layer-wise prefill (engine_adapter/prefill.py: per layer, the prompt's causal attention with SDPA
over its K/V on the device, the sequence's earlier tokens read from the store once, then the K/V
appended to the store), decode one token at a time (on CUDA one captured graph per token through
engine_adapter/graph_decode.py, else store.append + store.attend per layer; before each token the store places
background loads and pumps background saves), greedy `generate`.
K and V enter the store as fp16 with RoPE already applied to K; compute is in the model's
dtype (fp32 matches the HF reference best on CPU).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence

import torch

from engine_adapter.graph_decode import GraphDecoder, GraphDecoders
from engine_adapter.llama import Llama
from engine_adapter.prefill import prefill_hidden
from engine_adapter.row_decode import RowDecoder
from kvstore.decode.step import STEP_MODES, StepNotReady
from kvstore.store import KVStore

TokenIds = Sequence[int] | torch.Tensor


class Decoder:
    """Runs a Llama against a KVStore: chunked prefill, per-token decode, greedy generation.

    A step that fails part way (a full store, a bad mode) leaves the sequence with some layers
    ahead of others: free it. The store's length of a sequence is its next position."""

    def __init__(self, model: Llama, store: KVStore, graphs: bool = True) -> None:
        if model.args.spec != store.config.model:
            raise ValueError(f"store geometry {store.config.model} does not match the model's {model.args.spec}")
        self.model = model
        self.store = store
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        if self.device.type != store.device.type:
            raise ValueError(f"model on {self.device} but store on {store.device}; put both on one device type")
        self.graphs = graphs  # on CUDA, decode dense/topk through captured steps (False: always eager)
        self.graph_decoders = GraphDecoders(model, store)  # on CUDA: the captured decoders, by sequences
        self.paths = {"captured": 0, "eager": 0}  # decoded tokens by path (captured: through a GraphDecoder)

    def length(self, seq: int) -> int:
        """Tokens the sequence holds (its next position)."""
        return self.store.table(seq, 0).num_tokens

    def _tokens(self, token_ids: TokenIds) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)  # [T]
        vocab = self.model.args.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}), got range [{int(ids.min())}, {int(ids.max())}]")
        return ids

    @torch.no_grad()
    def forward_chunk(self, seq: int, token_ids: TokenIds, all_logits: bool = False) -> torch.Tensor:
        """Append one chunk to the sequence; fp32 logits [T, vocab] for its positions ([1, vocab]: the last)."""
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise ValueError("forward_chunk needs at least one token, got none")
        x = self._prefill_hidden(seq, ids, ids.numel())
        return self.model.logits(x if all_logits else x[-1:])

    def _prefill_hidden(self, seq: int, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        """The token ids recorded, then the layer-wise prefill of ids [T] after the sequence's tokens
        (engine_adapter/prefill.py); returns the last layer's hidden [T, dim]."""
        self._record_tokens(seq, ids)
        return prefill_hidden(self.model, self.store, seq, ids, chunk_tokens)

    def prefill_logits(self, seq: int, token_ids: TokenIds, chunk_tokens: int = 512,
                       all_logits: bool = True) -> Iterator[torch.Tensor]:
        """Prefill (layer-wise, chunk_tokens queries at a time), then yield each chunk's logits [t, vocab]
        (or [1, vocab], its last)."""
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token, got none")
        x = self._prefill_hidden(seq, ids, chunk_tokens)
        for begin in range(0, ids.numel(), chunk_tokens):
            h = x[begin: begin + chunk_tokens]
            with torch.no_grad():
                yield self.model.logits(h if all_logits else h[-1:])

    def prefill(self, seq: int, token_ids: TokenIds, chunk_tokens: int = 512) -> torch.Tensor:
        """Prefill the prompt; returns the logits [vocab] that predict the next token."""
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token, got none")
        with torch.no_grad():
            return self.model.logits(self._prefill_hidden(seq, ids, chunk_tokens)[-1:])[0]

    def prefill_shared(self, token_ids: TokenIds, chunk_tokens: int = 512) -> tuple[int, torch.Tensor, int]:
        """A new sequence for the prompt that starts on the longest prefix the store already holds (by
        token-id hash chain: store.match_prefix) and prefills only the rest (at least the last token, whose
        logits are returned). Returns (sequence, next-token logits [vocab], tokens reused)."""
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token, got none")
        match = self.store.match_prefix(ids[:-1].tolist())
        seq = self.store.create_sequence(prefix=match)
        try:
            return seq, self.prefill(seq, ids[match.num_tokens:], chunk_tokens), match.num_tokens
        except BaseException:
            self.free(seq)
            raise

    @torch.no_grad()  # not inference_mode: tensors the store allocates here must stay writable after
    def decode_step(self, seq: int, token_id: int, mode: str = "dense", budget: int = 4096) -> torch.Tensor:
        """Append one token and attend through the store; returns fp32 logits [vocab].

        On CUDA, the step's modes (kvstore/decode/step.py STEP_MODES) run the captured step (graph_decode.py:
        every layer's append, select and attend in one graph replay) whenever the step can serve every block
        (on the GPU, or selected from a cpu tier: kvstore/decode/step.py); otherwise, and on CPU, the eager path
        (store.append + store.attend per layer, same contract)."""
        return self.decode_batch([seq], [token_id], mode, budget)[0]

    @torch.no_grad()
    def decode_batch(self, seqs: Sequence[int], token_ids: Sequence[int], mode: str = "dense",
                     budget: int = 4096, rows: bool | None = None) -> torch.Tensor:
        """Append token_ids[i] to sequence seqs[i] for every i and attend; returns fp32 logits [B, vocab].

        On CUDA the B tokens run as one captured step (kvstore/decode/batch.py: the weight matmuls once for
        all of them, one attention launch per layer) whenever every sequence can run from device state;
        otherwise each sequence's token runs alone, eagerly if it must. Row i is what decode_step(seqs[i],
        token_ids[i]) returns alone: the same selection and attention; the weight matmuls' sums may round
        differently at another batch size. rows (default: for more than one sequence): sequences in Quest's
        topk phase (mode "topk") run in the rows of a bucketed batch (engine_adapter/row_decode.py), whose
        graph a sequence joining or leaving between tokens replays unchanged."""
        seqs, token_ids = list(seqs), [_token_id(t, self.model.args.vocab_size) for t in token_ids]
        if not seqs or len(seqs) != len(token_ids) or len(set(seqs)) != len(seqs):
            raise ValueError(f"decode_batch needs distinct sequences and one token id each, got {seqs} and "
                             f"{token_ids}")
        for seq in seqs:
            self.store.table(seq, 0)  # KeyError for an unknown sequence, before any token is recorded
        self._between_tokens()
        rows = len(seqs) > 1 if rows is None else rows
        logits, recorded = self._replay(seqs, token_ids, mode, budget, recorded=False, rows=rows)
        if logits is not None:
            return logits
        if len(seqs) > 1 or rows:  # one by one, each on its own captured step if it can
            return torch.stack([self._decode_alone(s, t, mode, budget, recorded) for s, t in zip(seqs, token_ids)])
        return self._decode_eager(seqs[0], token_ids[0], mode, budget, recorded)

    def _replay(self, seqs: list[int], token_ids: list[int], mode: str, budget: int,
                recorded: bool, rows: bool = False) -> tuple[torch.Tensor | None, bool]:
        """(logits [B, vocab], True) from the captured step of these sequences (rows: in a row decoder's rows
        if they can run there), or (None, whether the token ids are recorded already) when these tokens cannot
        run captured: nothing of their K/V happened then."""
        graph = self._graph_decoder(seqs, mode, budget, rows)
        if graph is None or not graph.ready():
            return None, recorded
        if not recorded:
            for seq, token in zip(seqs, token_ids):
                self._record_tokens(seq, [token])
        try:
            logits = graph(token_ids[0] if len(token_ids) == 1 else token_ids).clone()  # one id: no copy
        except StepNotReady:
            return None, True
        graph.step.verify()  # IntegrityError if a cpu block it read was damaged (syncs only if it read one)
        self.paths["captured"] += len(seqs)
        return logits, True

    def _decode_alone(self, seq: int, token_id: int, mode: str, budget: int, recorded: bool) -> torch.Tensor:
        """One sequence's token: its own captured step when it can run one, else eagerly."""
        logits, recorded = self._replay([seq], [token_id], mode, budget, recorded)
        return logits[0] if logits is not None else self._decode_eager(seq, token_id, mode, budget, recorded)[0]

    def _decode_eager(self, seq: int, token_id: int, mode: str, budget: int, recorded: bool) -> torch.Tensor:
        """store.append + store.attend per layer; fp32 logits [1, vocab]."""
        ids = self._tokens([token_id])
        self.paths["eager"] += 1
        if not recorded:
            self._record_tokens(seq, ids)
        pos = self.length(seq)
        cos, sin = self.model.rope(torch.tensor([pos], device=self.device), self.dtype)
        x = self.model.embed_tokens(ids)  # [1, dim]
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(x, cos, sin)
            self.store.append(seq, i, k.half(), v.half())
            attn = self.store.attend(seq, i, q[0].half(), mode=mode, budget=budget)  # [Hq, D] fp16
            x = layer.finish(x, attn[None])
        return self.model.logits(x)

    def _captures(self) -> bool:
        """Whether decode goes through GraphDecoder (CUDA graphs); on CPU its forward would run eagerly, which
        tests use to exercise the captured path's bookkeeping."""
        return self.graphs and self.device.type == "cuda"

    def _graph_decoder(self, seqs: Sequence[int], mode: str, budget: int,
                       rows: bool = False) -> GraphDecoder | RowDecoder | None:
        """The captured decoder of (seqs, mode, budget) on CUDA (GraphDecoders.get), else None."""
        if not self._captures() or mode not in STEP_MODES:
            return None
        return self.graph_decoders.get(seqs, mode, budget, rows)

    def generate(self, seq: int, prompt_ids: TokenIds, max_new_tokens: int, mode: str = "dense", budget: int = 4096,
                 chunk_tokens: int = 512, eos_id: int | None = None) -> list[int]:
        """Greedy: prefill the prompt, then decode up to max_new_tokens (stopping after eos_id)."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        logits = self.prefill(seq, prompt_ids, chunk_tokens)
        return self.continue_greedy(seq, logits, max_new_tokens, mode, budget, eos_id)

    def continue_greedy(self, seq: int, logits: torch.Tensor, max_new_tokens: int, mode: str = "dense",
                        budget: int = 4096, eos_id: int | None = None) -> list[int]:
        """Greedy tokens from next-token logits [vocab] of an already prefilled sequence."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        out = [int(logits.argmax())]
        if eos_id is None:  # nothing to stop on: no token's id is needed on the host before the end
            return out + self._run_ahead(seq, out[0], max_new_tokens - 1, mode, budget)
        while len(out) < max_new_tokens and out[-1] != eos_id:
            out.append(int(self.decode_step(seq, out[-1], mode, budget).argmax()))
        return out

    @torch.no_grad()
    def _run_ahead(self, seq: int, first: int, num_new: int, mode: str, budget: int) -> list[int]:
        """num_new greedy tokens after `first`, each token's input the last one's argmax on the device: on the
        captured path the host queues token t + 1 (its block-boundary work included) while the GPU runs
        token t and syncs once at the end, where a per-token loop pays its host work and a sync every token.
        A token that cannot run captured (cold blocks, capacity) goes through decode_step with its id synced.
        Token ids reach the store (content keys) when the host learns them: before an eager token and at the
        end (store.extend_tokens(..., catch_up=True): exactly the ids of K/V already appended)."""
        ids = torch.empty(num_new + 1, dtype=torch.long, device=self.device)  # [1 + num_new]: inputs, last output
        ids[0] = first
        track, recorded = self.store.tracks_tokens(seq), 0  # ids[:recorded] are in the store's token record

        def record(upto: int) -> None:
            nonlocal recorded
            if track and upto > recorded:
                self.store.extend_tokens(seq, ids[recorded:upto].tolist(), catch_up=True)
            recorded = max(recorded, upto)

        for i in range(num_new):  # token i appends ids[i] and writes ids[i + 1]
            self._between_tokens()
            graph, logits = self._graph_decoder([seq], mode, budget), None
            if graph is not None:  # begin_token checks readiness again and refuses with StepNotReady
                try:
                    logits = graph(ids[i: i + 1])[0]
                    self.paths["captured"] += 1
                except StepNotReady:  # nothing of this token happened: the eager path below runs it
                    pass
            if logits is None:
                record(i)
                token = int(ids[i])
                logits = self.decode_step(seq, token, mode, budget)  # records the token's id itself
                recorded = i + 1
            ids[i + 1] = logits.argmax()
        for graph in self.graph_decoders.of(seq):
            graph.step.verify()  # every cpu slice read on the way was intact, or IntegrityError
        record(num_new)
        return ids[1:].tolist()

    def fork(self, seq: int) -> int:
        """A new sequence on seq's K/V (store.fork: full blocks shared, the partial tail copied), so several
        decode modes or questions share one prefill."""
        return self.store.fork(seq)

    def _record_tokens(self, seq: int, ids: TokenIds) -> None:
        """Token ids go to the store (content keys for prefix reuse, saved contexts) whenever it knows the
        sequence's ids from position 0 (not for K/V written without ids, e.g. a random fill)."""
        if self.store.tracks_tokens(seq):
            self.store.extend_tokens(seq, ids)

    def free(self, seq: int, background: bool = False) -> None:
        """store.free(seq, background): background, its blocks return to the tiers a bounded batch before each
        later token."""
        self.store.free(seq, background)
        self.graph_decoders.drop(seq)

    def _between_tokens(self) -> None:
        """The store's bounded host work before a token: blocks read by background loads placed (a sequence may
        run captured now), the next part of background saves copied out for their writers, the next batch of
        background-freed blocks returned."""
        self.store.place_loaded()
        self.store.pump_saves()
        self.store.release_freed()


def _token_id(token: object, vocab_size: int) -> int:
    """A token id as an int in [0, vocab_size) (a Python, numpy or 0-d tensor integer), else ValueError."""
    try:
        value = operator.index(token)
    except TypeError:
        value = None
    if value is None or isinstance(token, bool) or not 0 <= value < vocab_size:
        raise ValueError(f"token id must be an int in [0, {vocab_size}), got {token!r}")
    return value
