"""Write Hugging Face checkpoints of Megatron weights: the checkpoint an SGLang engine starts
from (its tensor table is then exactly what :func:`~.megatron_export.gather_hf_weights`
produces), and the reference a synced engine is compared with.

The safetensors format is written directly: an 8-byte little-endian header length, the JSON
header, then the raw bytes. So the trainer needs no safetensors package.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from titan_weight_sync.layout import ALIGN, NAMES


def save_safetensors(weights: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write ``weights`` (CPU tensors) to one ``.safetensors`` file, names sorted."""
    header: dict[str, Any] = {}
    offset = 0
    ordered = sorted(weights)
    for name in ordered:
        tensor = weights[name]
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)  # the format pads the header with spaces
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in ordered:
            data = weights[name].detach().contiguous().cpu().view(torch.uint8).reshape(-1)
            f.write(data.numpy().tobytes())
    os.replace(tmp, path)


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` file (copies, in the file's dtypes)."""
    from titan_weight_sync.layout import DTYPES, MAX_HEADER_BYTES

    raw = Path(path).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    if length > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise ValueError(f"{path}: safetensors header of {length} bytes")
    header = json.loads(raw[8 : 8 + length])
    base = 8 + length
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        data = bytearray(raw[base + start : base + end])
        flat = torch.frombuffer(data, dtype=DTYPES[info["dtype"]]) if data else torch.empty(0)
        out[name] = flat.reshape(info["shape"])
    return out


def llama_config(cfg: Any, vocab_size: int, max_positions: int, rope_theta: float) -> dict:
    """The ``config.json`` of the Llama-style model a Megatron ``TransformerConfig`` describes
    (RMSNorm, SwiGLU, rotary embeddings, untied output layer); Qwen2's when the attention has
    a qkv bias, Mixtral's for a MoE model."""
    heads = cfg.num_attention_heads
    qwen2 = bool(getattr(cfg, "add_qkv_bias", False))
    moe = {}
    if cfg.num_moe_experts:
        moe = {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": cfg.num_moe_experts,
            "num_experts_per_tok": cfg.moe_router_topk,
            "intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        }
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_query_groups or heads,
        "head_dim": cfg.kv_channels or cfg.hidden_size // heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": rope_theta,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
        "attention_bias": qwen2,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    } | moe


def save_checkpoint(
    weights: Mapping[str, torch.Tensor], config: dict, directory: str | Path, dtype: torch.dtype
) -> Path:
    """A loadable Hugging Face checkpoint (``config.json`` + ``model.safetensors``) of
    ``weights`` cast to ``dtype``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cast = {name: t.detach().to(dtype).contiguous() for name, t in weights.items()}
    save_safetensors(cast, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype)[6:]}))
    return directory
