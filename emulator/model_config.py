"""A model's shape read from its Hugging Face ``config.json``: what the capacity and physics
models need (``kvscope simulate --model-config FILE``).

The planner's two built-in models (:data:`kvscope.emulator.capacity.MODELS`) are the published
sweep's; any other model is read here from the config its checkpoint ships, the same file vLLM
reads (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``intermediate_size``, ``vocab_size``, ``torch_dtype``, the MoE and MLA fields).
Nothing here downloads: the file is the user's.

**Parameters** are counted from the shapes, as the checkpoint's tensors are laid out (norms and
biases left out: well under 0.1 %):

* embeddings ``vocab × hidden``, and the LM head again unless ``tie_word_embeddings``;
* attention per layer: GQA ``hidden × (heads + 2 · kv_heads) · head_dim`` for Q, K, V and
  ``heads · head_dim × hidden`` for O; MLA (``kv_lora_rank`` present, the DeepSeek-V2/V3 layout)
  the low-rank Q (``q_lora_rank``, or a full projection without it), the joint KV down
  projection ``hidden × (kv_lora_rank + rope)``, its up projection ``kv_lora_rank × heads ·
  (nope + v_head_dim)`` and O ``heads · v_head_dim × hidden``;
* the MLP: ``3 × hidden × intermediate`` (gate, up, down); a MoE layer has every routed expert
  (``n_routed_experts`` / ``num_experts`` / ``num_local_experts`` × ``moe_intermediate_size``),
  its shared experts and the router; the first ``first_k_dense_replace`` layers stay dense.

Active parameters count the ``num_experts_per_tok`` routed experts and the shared ones instead of
all. Checked against published totals (``tests/emulator/test_model_config.py``): Qwen3-32B
32.8 B, Llama-3.1-70B 70.6 B, DeepSeek-V3 671 B with 37 B active.

**KV bytes per token** in the model's dtype (vLLM's ``kv_cache_dtype`` "auto"): GQA ``layers ×
kv_heads × head_dim × 2`` (K and V); MLA ``layers × (kv_lora_rank + qk_rope_head_dim)`` (one
latent, replicated on every rank; a DeepSeek-V3.2 indexer's small key cache is left out).

**Physics.** The attention width is ``heads × head_dim`` (MLA: ``heads × (nope + rope)``); FP8
weights when ``quantization_config.quant_method`` is ``fp8``; vLLM's MLA backends (FlashMLA, its
sparse form) take 64-token blocks, the others 16; a rank registers one NIXL region per layer,
two with a DeepSeek-V3.2 indexer (``index_topk``). Efficiency is borrowed from the fitted model
of its family (:data:`kvscope.emulator.physics.FITTED`): MoE or MLA models GLM-5-FP8's, dense
ones Qwen3-32B's. That is an assumption, not a fit: no published point exists for the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvscope.emulator.capacity import GLM5_FP8, QWEN3_32B, CapacityError, ModelShape

_DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "half": 2.0, "float32": 4.0, "float": 4.0}
# vLLM's MLA attention backends: FlashMLA and FLASHMLA_SPARSE accept 64-token blocks only.
_MLA_BLOCK_TOKENS = 64
_BLOCK_TOKENS = 16


def load(path: str | Path) -> ModelShape:
    """The shape of the model whose ``config.json`` is at ``path``; CapacityError naming the file
    and what is missing or wrong."""
    file = Path(path)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CapacityError(f"{file}: cannot read the model config ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CapacityError(f"{file}: not a JSON model config ({exc})") from None
    if not isinstance(config, dict):
        raise CapacityError(f"{file}: not a JSON object (a model's config.json is one)")
    # A checkpoint's config.json is named by its folder; any other file by its own name.
    named = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return shape(config, name=str(config.get("_name_or_path") or named), where=str(file))


def shape(config: Mapping[str, Any], *, name: str, where: str = "config") -> ModelShape:
    """The shape a parsed ``config.json`` describes (a multimodal config's ``text_config``)."""
    text = config.get("text_config")
    c = _Fields(text if isinstance(text, Mapping) else config, where)
    hidden, layers = c.int("hidden_size"), c.int("num_hidden_layers")
    heads, vocab = c.int("num_attention_heads"), c.int("vocab_size")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in _DTYPE_BYTES:
        raise CapacityError(f"{where}: torch_dtype {dtype!r} is not one of "
                            f"{', '.join(_DTYPE_BYTES)}")
    element = _DTYPE_BYTES[dtype]
    quant = config.get("quantization_config")
    fp8 = isinstance(quant, Mapping) and str(quant.get("quant_method", "")).lower() == "fp8"
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)

    mla = c.get("kv_lora_rank") is not None
    if mla:
        rank, rope = c.int("kv_lora_rank"), c.int("qk_rope_head_dim")
        nope, v_dim = c.int("qk_nope_head_dim"), c.int("v_head_dim")
        q_rank = c.get("q_lora_rank")
        q_out = heads * (nope + rope)
        query = (hidden * q_out if q_rank is None
                 else hidden * c.int("q_lora_rank") + c.int("q_lora_rank") * q_out)
        attention = (query + hidden * (rank + rope) + rank * heads * (nope + v_dim)
                     + heads * v_dim * hidden)
        kv_heads, head_dim, attention_dim = 1, rank + rope, q_out
        kv_bytes = layers * (rank + rope) * element
    else:
        head_dim = int(c.get("head_dim") or hidden // heads)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        attention_dim = heads * head_dim
        kv_bytes = layers * kv_heads * head_dim * 2 * element

    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
    dense_mlp = 3 * hidden * int(c.get("intermediate_size") or 0)
    if experts:
        per_expert = 3 * hidden * int(c.get("moe_intermediate_size")
                                      or c.int("intermediate_size"))
        shared = (int(c.get("n_shared_experts") or 0) * per_expert
                  + 3 * hidden * int(c.get("shared_expert_intermediate_size") or 0))
        top_k = c.int("num_experts_per_tok")
        router = hidden * int(experts)
        dense_layers = int(c.get("first_k_dense_replace") or 0)
        moe_layers = layers - dense_layers
        if dense_layers and not dense_mlp:
            raise CapacityError(f"{where}: first_k_dense_replace {dense_layers} needs "
                                "intermediate_size (the dense layers' MLP)")
        mlp_all = dense_layers * dense_mlp + moe_layers * (int(experts) * per_expert + shared
                                                            + router)
        mlp_active = dense_layers * dense_mlp + moe_layers * (top_k * per_expert + shared + router)
    else:
        if not dense_mlp:
            raise CapacityError(f"{where}: no intermediate_size (and no experts): the MLP's "
                                "size is unknown")
        mlp_all = mlp_active = layers * dense_mlp
    parameters = embeddings + layers * attention + mlp_all
    active = embeddings + layers * attention + mlp_active
    moe_or_mla = bool(experts) or mla
    return ModelShape(
        name=name, parameters=float(parameters), active_parameters=float(active),
        layers=layers, kv_heads=kv_heads, head_dim=head_dim,
        weight_bytes=1.0 if fp8 else element, kv_bytes_per_token=int(kv_bytes),
        attention_dim=attention_dim, fp8_weights=fp8,
        kv_block_tokens=_MLA_BLOCK_TOKENS if mla else _BLOCK_TOKENS,
        nixl_regions=layers * (2 if mla and c.get("index_topk") is not None else 1),
        family=(GLM5_FP8 if moe_or_mla else QWEN3_32B).name)


class _Fields:
    """A config's fields, each missing or ill-typed one an error naming it and the file."""

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        self._config, self._where = config, where

    def get(self, key: str, default: Any = None) -> Any:
        return self._config.get(key, default)

    def int(self, key: str) -> int:
        value = self._config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            found = "missing" if value is None else f"{value!r}"
            raise CapacityError(f"{self._where}: {key} is {found}; a positive whole number "
                                "is needed")
        return value


__all__ = ["load", "shape"]
