"""`kvtier bench formats` starts each run at a hot window from the fp16 baseline's K/V of the tokens below that window
(they never see a warm block): the NLL it reports must be the one a full read-back run gives."""

from __future__ import annotations

import pytest
import torch

from bench_longctx.presets import FormatsPreset
from bench_longctx.real_qk import real_text
from bench_longctx.warm_formats import attend, format_nll, relative_error, store_for
from engine_adapter.decoder import Decoder
from engine_adapter.evaluate import read_back_nll
from tests.engine_adapter import smollm2

TOKENS, HOT = 512, 256


@pytest.mark.parametrize("warm_format", ["fp8", "int4"])
def test_a_run_from_the_shared_prefix_gives_the_full_runs_nll(warm_format: str) -> None:
    _, tokenizer, model = smollm2.smollm2()
    p = FormatsPreset(tokens=TOKENS, hot_tokens=(HOT,), formats=(warm_format,))
    text, cpu = real_text(tokenizer, TOKENS), torch.device("cpu")
    with store_for(model.args.spec, cpu, p, TOKENS, None, 0) as store:
        seq = store.create_sequence()
        base_nll = read_back_nll(Decoder(model, store), seq, text, p.chunk_tokens)
        base_kv = [store.read(seq, layer) for layer in range(model.args.num_layers)]
    with store_for(model.args.spec, cpu, p, TOKENS, warm_format, HOT) as store:
        full = read_back_nll(Decoder(model, store), store.create_sequence(), text, p.chunk_tokens)
        assert store.stats()["tiers"]["warm"]["blocks"] > 0  # the tail of the run did read warm blocks
    run = format_nll(model, p, cpu, text, (base_nll, base_kv), warm_format, HOT)
    assert run["shared_tokens"] == HOT
    torch.testing.assert_close(run["nll"], full, rtol=0, atol=1e-5)
    assert not torch.allclose(full[HOT + 64:], base_nll[HOT + 64:], atol=1e-3)  # past the window it is not fp16's


def test_attention_error_is_relative_to_the_reference_output() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 16, generator=g)  # [S, Hq, D]
    k, v = torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g)  # [T, H, D]
    ref = attend(q, k, v)
    weights = torch.softmax(torch.einsum("shd,thd->sht", q, k.repeat_interleave(3, 1)) / 4.0, dim=-1)
    torch.testing.assert_close(ref, torch.einsum("sht,thd->shd", weights, v.repeat_interleave(3, 1)))
    assert relative_error(ref, ref).max() == 0
    torch.testing.assert_close(relative_error(1.1 * ref, ref), torch.full((3, 6), 0.1))
