"""`kvtier bench formats`: what each warm format (int8, fp8, int4) costs in answers, SmolLM2-135M on real text.

The text is bench_longctx.real_qk.real_text (tests/data/prose.txt, then Python's reference documentation from
`pydoc_data.topics`, which every CPython ships): nothing downloads. Every number is against fp16 in the same run.

perplexity  over `tokens` tokens, prefilled `chunk_tokens` per call so each chunk attends to the earlier tokens as
            the store reads them back: sinks and the last `hot` tokens fp16, the rest in the warm format. The fp16
            baseline keeps every block hot. Positions below a hot window only ever see fp16 blocks, so a run at that
            window starts from the baseline's K/V of its first `hot` tokens (checked: none of them is warm) and their
            NLL, and prefills only the rest.
passkey     per depth, the prompt but its question is prefilled once (one call: fp16 K/V) and stored in each format's
            store per hot window; the question is then prefilled as a call of its own over the stored prompt and the
            answer decoded dense (every block attended), as in the fp16 store.
attention   per layer, the relative error |o - o_fp16| / |o_fp16| of the attention output of `queries` real queries
            (the text's next positions) over the baseline's K/V of `tokens` tokens, as each format's store reads them
            back per hot window; mean and max over queries and q heads.
"""

from __future__ import annotations

import math
import random
import time

import torch

from bench_longctx.models import Models, model_store
from bench_longctx.presets import FormatsPreset
from bench_longctx.real_qk import next_queries, real_text
from engine_adapter.decoder import Decoder
from engine_adapter.evaluate import NEEDLE, Tokenizer, passkey_prompt, read_back_nll, read_passkey
from engine_adapter.llama import Llama
from kvstore.config import ModelSpec
from kvstore.store import KVStore

MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, fp32)"
QUESTION_TOKENS = 16  # the prompt's tail prefilled over the stored prompt: the question and a little filler
ANSWER_TOKENS = 6
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [T, H, D] fp16


def store_for(spec: ModelSpec, device: torch.device, p: FormatsPreset, tokens: int, warm_format: str | None,
              hot_tokens: int) -> KVStore:
    """warm_format None: the fp16 baseline (every block hot); else sinks + hot_tokens fp16, the rest warm_format."""
    if warm_format is None:
        return model_store(spec, device, hot_tokens=tokens + 256, warm_tokens=0, sink_tokens=p.sink_tokens,
                           recent_tokens=64, sequences=1)
    return model_store(spec, device, hot_tokens=hot_tokens, warm_tokens=tokens + 256, sink_tokens=p.sink_tokens,
                       recent_tokens=min(64, hot_tokens), sequences=1, warm_format=warm_format)


def held(store: KVStore, seq: int, kv: KV, token_ids: list[int]) -> None:
    """Store kv (every layer) as seq's tokens token_ids, as a prefill of them would."""
    store.extend_tokens(seq, token_ids)
    for layer, (k, v) in enumerate(kv):
        store.append(seq, layer, k, v)


def warm_share(store: KVStore) -> float:
    tiers = store.stats()["tiers"]
    return tiers["warm"]["blocks"] / max(1, tiers["warm"]["blocks"] + tiers["hot"]["blocks"])


def format_nll(model: Llama, p: FormatsPreset, device: torch.device, text: list[int], base: tuple[torch.Tensor, KV],
               warm_format: str, hot_tokens: int) -> dict:
    """NLL [len(text) - 1] of text read back from a warm_format store with hot_tokens fp16 (the first `shared`
    positions taken from the baseline, whose K/V they share), the store's warm share, and wall time."""
    base_nll, base_kv = base
    shared = min(hot_tokens, len(text) - 2) // p.chunk_tokens * p.chunk_tokens
    start = time.perf_counter()
    with store_for(model.args.spec, device, p, len(text), warm_format, hot_tokens) as store:
        seq = store.create_sequence()
        if shared:
            held(store, seq, [(k[:shared], v[:shared]) for k, v in base_kv], text[:shared])
            if store.stats()["tiers"]["warm"]["blocks"]:
                raise RuntimeError(f"{shared} shared tokens must all be hot at hot_tokens={hot_tokens}")
        rest = read_back_nll(Decoder(model, store), seq, text[shared:], p.chunk_tokens)
        share = warm_share(store)
    return {"nll": torch.cat([base_nll[:shared], rest]), "shared_tokens": shared, "warm_share": share,
            "wall_s": time.perf_counter() - start}


def perplexity_rows(model: Llama, p: FormatsPreset, device: torch.device, text: list[int],
                    base: tuple[torch.Tensor, KV], progress) -> list[dict]:
    base_nll = base[0]
    rows = [{"format": "fp16", "hot_tokens": None, "ppl": math.exp(float(base_nll.mean())), "shared_tokens": 0,
             "warm_share": 0.0}]
    cells = [(hot, fmt) for hot in p.hot_tokens for fmt in p.formats]
    for hot, fmt in progress(cells, "formats perplexity"):
        run = format_nll(model, p, device, text, base, fmt, hot)
        nll = run.pop("nll")
        past = nll[hot + p.sink_tokens:]  # positions that can see a warm block
        rows.append({"format": fmt, "hot_tokens": hot, "ppl": math.exp(float(nll.mean())), **run,
                     "past_window_tokens": len(past),
                     "past_window_ppl": math.exp(float(past.mean())) if len(past) else None,
                     "past_window_fp16_ppl": math.exp(float(base_nll[hot + p.sink_tokens:].mean())) if len(past)
                     else None})
    for r in rows:
        r["delta_vs_fp16"] = r["ppl"] - rows[0]["ppl"]
        if r.get("past_window_ppl") is not None:
            r["past_window_delta"] = r["past_window_ppl"] - r["past_window_fp16_ppl"]
    return rows


def attention_rows(spec: ModelSpec, p: FormatsPreset, device: torch.device, kv: KV,
                   queries: list[torch.Tensor]) -> list[dict]:
    """Per (format, hot window, layer): the relative error of the attention output over the read-back K/V."""
    rows = []
    reference = [attend(q, k, v) for q, (k, v) in zip(queries, kv)]
    for hot in p.hot_tokens:
        for fmt in p.formats:
            with store_for(spec, device, p, len(kv[0][0]), fmt, hot) as store:
                seq = store.create_sequence()
                for layer, ((k, v), q, ref) in enumerate(zip(kv, queries, reference)):
                    store.append(seq, layer, k, v)
                    err = relative_error(attend(q, *store.read(seq, layer)), ref)  # [S, Hq]
                    rows.append({"format": fmt, "hot_tokens": hot, "layer": layer, "mean": float(err.mean()),
                                 "max": float(err.max())})
                share = warm_share(store)
            for r in rows[-len(kv):]:
                r["warm_share"] = share
    return rows


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 attention of q [S, Hq, D] over all of k, v [T, H, D] (GQA) -> [S, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))  # [T, Hq, D]
    weights = torch.softmax(torch.einsum("shd,thd->sht", q.float(), k) * q.shape[-1] ** -0.5, dim=-1)
    return torch.einsum("sht,thd->shd", weights, v)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12)


def answer(decoder: Decoder, seq: int, question: list[int], tokenizer: Tokenizer) -> str | None:
    """The passkey read from a dense greedy answer to question, prefilled as a call of its own over seq."""
    logits = decoder.prefill(seq, question)
    budget = decoder.length(seq) + ANSWER_TOKENS
    return read_passkey(tokenizer.decode(decoder.continue_greedy(seq, logits, ANSWER_TOKENS, "dense", budget)))


def needle_position(prompt: list[int], tokenizer: Tokenizer, passkey: str) -> int:
    needle = tokenizer(NEEDLE.format(key=passkey), add_special_tokens=False)["input_ids"]
    return next(i for i in range(len(prompt)) if prompt[i: i + len(needle)] == needle)


def passkey_rows(model: Llama, tokenizer: Tokenizer, p: FormatsPreset, device: torch.device, progress) -> list[dict]:
    spec, rng, rows = model.args.spec, random.Random(p.passkey_context), []
    for depth in progress(list(p.depths), "formats passkey"):
        passkey = f"{rng.randrange(10000, 100000)}"
        prompt = passkey_prompt(tokenizer, p.passkey_context, depth, passkey)
        body, question = prompt[:-QUESTION_TOKENS], prompt[-QUESTION_TOKENS:]
        common = {"depth": depth, "passkey": passkey, "needle_position": needle_position(prompt, tokenizer, passkey)}
        with store_for(spec, device, p, len(prompt), None, 0) as store:
            decoder, seq = Decoder(model, store), store.create_sequence()
            decoder.prefill(seq, body)
            kv = [store.read(seq, layer) for layer in range(spec.num_layers)]
            dense = answer(decoder, seq, question, tokenizer)
        rows.append({**common, "format": "fp16", "hot_tokens": None, "answer": dense, "needle_warm": False})
        for hot in p.hot_tokens:
            for fmt in p.formats:
                with store_for(spec, device, p, len(prompt), fmt, hot) as store:
                    seq = store.create_sequence()
                    held(store, seq, kv, body)
                    got = answer(Decoder(model, store), seq, question, tokenizer)
                warm = p.sink_tokens <= common["needle_position"] < len(body) - hot
                rows.append({**common, "format": fmt, "hot_tokens": hot, "answer": got, "needle_warm": warm})
        for r in rows[-1 - len(p.hot_tokens) * len(p.formats):]:
            r["correct"], r["as_fp16"] = r["answer"] == passkey, r["answer"] == dense
    return rows


def run_formats(p: FormatsPreset, device: torch.device, models: Models, progress) -> dict:
    note = models.note()
    if note:
        return {"skipped": note}
    model, tokenizer = models.smollm2()
    spec = model.args.spec
    ids = real_text(tokenizer, p.tokens + p.queries)
    text = ids[: p.tokens]
    start = time.perf_counter()
    with store_for(spec, device, p, len(text), None, 0) as store:
        seq = store.create_sequence()
        base_nll = read_back_nll(Decoder(model, store), seq, text, p.chunk_tokens)
        if store.stats()["tiers"]["warm"]["blocks"]:
            raise RuntimeError("the fp16 baseline store holds warm blocks")
        kv = [store.read(seq, layer) for layer in range(spec.num_layers)]
    baseline_s = time.perf_counter() - start
    perplexity = perplexity_rows(model, p, device, text, (base_nll, kv), progress)
    perplexity[0]["wall_s"] = baseline_s
    queries = next_queries(model, kv, ids[p.tokens:])
    attention = attention_rows(spec, p, device, kv, queries)
    del kv
    return {"model": MODEL, "text": "tests/data/prose.txt + pydoc_data.topics", "tokens": len(text),
            "chunk_tokens": p.chunk_tokens, "sink_tokens": p.sink_tokens, "perplexity": perplexity,
            "attention": {"queries": p.queries, "context": len(text), "rows": attention},
            "passkey": {"context": p.passkey_context, "question_tokens": QUESTION_TOKENS,
                        "rows": passkey_rows(model, tokenizer, p, device, progress)}}
