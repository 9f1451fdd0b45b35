"""Decoder-only transformers in plain PyTorch, reading and writing a paged KV cache.

Two architectures: Llama (also Qwen2 / Mistral-style checkpoints: RMSNorm, RoPE, GQA, SwiGLU,
optional q/k/v biases; Llama 3.1's "llama3" RoPE frequency scaling; Qwen3's RMSNorm of each query
and key head before RoPE; Mixtral's and Qwen3-MoE's mixture-of-experts MLPs, each token through
the top k of the layer's experts by its router) and GPT-2 (learned positions,
LayerNorm, Conv1D weights stored [in, out]). Sliding-window attention (Mistral; Qwen2's
`use_sliding_window` on its layers from `max_window_layers`; any `layer_types` list): a windowed
layer's queries attend to their last `sliding_window` positions only, themselves included, by
mask; the cache still keeps every position (blocks that fall out of the window are not freed).

All tokens of a step are flattened into one [T, hidden] batch for every linear layer; only
attention is grouped (see `attention`). The KV cache of layer l is a pair of tensors

    k_cache[l], v_cache[l] : [num_blocks * block_size, num_kv_heads, head_dim]   (one row per slot)

and a token at position p of a sequence lives in slot table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sluice.errors import ConfigError

__all__ = ["AttentionGroup", "CausalLM", "ForwardInput", "KVCache", "Llama3RopeScaling", "ModelSpec", "load_model",
           "read_spec"]


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling: frequencies whose wavelength is long compared with the
    original context are divided by `factor`, short ones are kept, and those between are blended.

        wavelength   < original / high_freq_factor   kept
        wavelength   > original / low_freq_factor    divided by factor
        in between                                   (1 - s) * f / factor + s * f,
                                                     s = (original / wavelength - low) / (high - low)
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
                and self.original_max_position_embeddings > 0):
            raise ConfigError("llama3 rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                              "original_max_position_embeddings > 0")

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        original = self.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        blend = ((original / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor))
        blended = (1 - blend) * inv_freq / self.factor + blend * inv_freq
        scaled = torch.where(wavelength > original / self.low_freq_factor, inv_freq / self.factor, blended)
        return torch.where(wavelength < original / self.high_freq_factor, inv_freq, scaled)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    arch: str  # "llama" | "gpt2"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    norm_eps: float
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    scale_by_layer: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    sliding_window: int | None = None
    """Windowed layers attend to at most this many positions, their own included; None: none is."""
    windowed_layers: frozenset[int] = frozenset()
    """The layers that use `sliding_window`."""
    qk_norm: bool = False
    """Each query and key head is RMS-normalised (its own weights) before RoPE (Qwen3)."""
    num_experts: int = 0
    """A mixture-of-experts MLP's experts (Mixtral, Qwen3-MoE); 0: every MLP is dense."""
    experts_per_token: int = 0
    """The top k experts by the router that each token goes through."""
    norm_topk_prob: bool = True
    """The k chosen experts' router probabilities are renormalised to sum to 1 (Mixtral always)."""
    moe_layers: frozenset[int] = frozenset()
    """The layers whose MLP is the mixture (Qwen3-MoE may keep some dense)."""
    router_weights_in_model_dtype: bool = False
    """The chosen experts' weights are cast to the model's dtype before they weigh their outputs
    (Qwen3-MoE); else they weigh them in float32 (Mixtral)."""


def read_spec(model_dir: Path) -> ModelSpec:
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type", "")
    if model_type == "gpt2":
        if config.get("activation_function", "gelu_new") != "gelu_new":
            raise ConfigError("only GPT-2's gelu_new activation is supported")
        hidden = config["n_embd"]
        heads = config["n_head"]
        return ModelSpec("gpt2", config["n_layer"], hidden, heads, heads, hidden // heads,
                         config["vocab_size"], config["n_positions"], config.get("layer_norm_epsilon", 1e-5),
                         tie_word_embeddings=True,
                         scale_by_layer=bool(config.get("scale_attn_by_inverse_layer_idx", False)))
    if model_type in ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"):
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError("only the SiLU (SwiGLU) MLP is supported")
        heads = config["num_attention_heads"]
        return ModelSpec("llama", config["num_hidden_layers"], config["hidden_size"], heads,
                         config.get("num_key_value_heads") or heads,
                         config.get("head_dim") or config["hidden_size"] // heads, config["vocab_size"],
                         config.get("max_position_embeddings", 2048), config.get("rms_norm_eps", 1e-6),
                         rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                         tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                         rope_scaling=_rope_scaling(rope), qk_norm=model_type in ("qwen3", "qwen3_moe"),
                         **_sliding_window(config), **_mixture(config))
    raise ConfigError(f"unsupported model_type {model_type!r} "
                      "(supported: llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, gpt2)")


def _rope_scaling(rope: dict[str, object]) -> Llama3RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"RoPE scaling {kind!r} is not supported (supported: default, llama3)")
    try:
        return Llama3RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),  # type: ignore[arg-type]
                                 float(rope["high_freq_factor"]),  # type: ignore[arg-type]
                                 int(rope["original_max_position_embeddings"]))  # type: ignore[call-overload]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"llama3 rope_scaling needs factor, low_freq_factor, high_freq_factor and "
                          f"original_max_position_embeddings: {exc!r}") from exc


def _sliding_window(config: dict[str, Any]) -> dict[str, Any]:
    """The attention window and the layers that use it, where the checkpoint has one: every layer
    (Mistral), those `layer_types` names "sliding_attention", or Qwen2's layers from
    `max_window_layers` on when `use_sliding_window` is set (as transformers reads them; Qwen3's too)."""
    window = config.get("sliding_window")
    qwen = config.get("model_type") in ("qwen2", "qwen3", "qwen3_moe")
    if window is None or (qwen and not config.get("use_sliding_window", False)):
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        layers = {i for i, kind in enumerate(layer_types) if kind == "sliding_attention"}
    elif qwen:
        layers = set(range(int(config.get("max_window_layers", num_layers)), num_layers))
    else:
        layers = set(range(num_layers))
    return {"sliding_window": window, "windowed_layers": frozenset(layers)} if layers else {}


def _mixture(config: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts checkpoint's experts, top k and sparse layers (as transformers reads
    them: Mixtral's on every layer; Qwen3-MoE's on every `decoder_sparse_step`-th, but those in
    `mlp_only_layers`)."""
    model_type = config.get("model_type")
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)  # (transformers 5 writes
    # Qwen3-MoE's under Mixtral's name; the published checkpoints have "num_experts")
    top_k = int(config.get("num_experts_per_tok", 2))
    if not 0 < top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok must be between 1 and the {num_experts} experts (num_experts), "
                          f"got {top_k}")
    num_layers = config["num_hidden_layers"]
    if model_type == "mixtral":
        return {"num_experts": num_experts, "experts_per_token": top_k, "moe_layers": frozenset(range(num_layers))}
    step, dense = int(config.get("decoder_sparse_step", 1)), set(config.get("mlp_only_layers") or ())
    layers = frozenset(i for i in range(num_layers) if i not in dense and step > 0 and (i + 1) % step == 0)
    return {"num_experts": num_experts, "experts_per_token": top_k, "moe_layers": layers,
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)), "router_weights_in_model_dtype": True}


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences attended together: B rows of Q query tokens over L gathered cache slots."""

    token_index: torch.Tensor  # [B * Q] rows of the flattened batch
    slots: torch.Tensor        # [B, L] cache slots to read (padding reads slot 0, masked out)
    mask: torch.Tensor         # [B, 1, Q, L] True where the query may attend
    num_seqs: int
    num_queries: int
    window_mask: torch.Tensor | None = None  # the same, for the model's windowed layers
    covers_all: bool = False  # one query per row and every row of the batch, in order (a pure decode step)
    fresh_rows: tuple[int, int] | None = None
    """A prompt's first chunk, rows [a, b) of the batch: its keys are its own queries' tokens, so it
    attends causally over this step's K and V (no gather, no mask: FlashAttention on CUDA)."""


@dataclass(frozen=True, slots=True)
class ForwardInput:
    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    groups: tuple[AttentionGroup, ...]
    logits_index: torch.Tensor  # [N] rows whose next-token logits are wanted
    windowed_layers: frozenset[int] = frozenset()  # layers that attend with `AttentionGroup.window_mask`


class KVCache:
    """Every layer's keys and values, slot by slot: `num_blocks` blocks of `block_size` slots, and one
    block more (`scratch_block`) that no sequence owns: the padding rows of a captured decode step
    (`model_runner.DecodeGraph`) write and read there."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> None:
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        shape = (spec.num_layers, (num_blocks + 1) * block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * itemsize


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache,
              inp: ForwardInput, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each group over its gathered slots (a
    prompt's first chunk over this step's own K/V, causally)."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    k_cache.index_copy_(0, inp.slot_mapping, k)
    v_cache.index_copy_(0, inp.slot_mapping, v)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    out = q.new_empty(q.shape)
    for g in inp.groups:
        windowed = g.window_mask is not None and layer in inp.windowed_layers
        if g.fresh_rows is not None and not windowed:
            a, b = g.fresh_rows
            qq, kk, vv = (x[a:b].unsqueeze(0).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=kv_heads != heads)
            out[a:b] = o[0].transpose(0, 1)
            continue
        # index_select on the flattened slots, not k_cache[g.slots]: advanced indexing with a 2-D
        # index was 56% of a CPU decode step at 32 sequences; this gather is several times faster.
        kk = _gather(k_cache, g.slots)  # [B, kv_heads, L, D]
        vv = _gather(v_cache, g.slots)
        mask = g.window_mask if windowed else g.mask
        # a pure decode step in one group attends with the batch's own rows: no copy in or out
        rows = q if g.covers_all else q[g.token_index]
        if g.num_queries == 1:
            # one query per sequence: the query heads that share a KV head are that head's queries
            # ([B, kv_heads, heads / kv_heads, D]), so K and V are never repeated per query head
            o = F.scaled_dot_product_attention(rows.reshape(g.num_seqs, kv_heads, heads // kv_heads, head_dim),
                                               kk, vv, attn_mask=mask, scale=scale).reshape(-1, heads, head_dim)
        else:
            qq = rows.view(g.num_seqs, g.num_queries, heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=kv_heads != heads)
            o = o.transpose(1, 2).reshape(-1, heads, head_dim)
        if g.covers_all:
            return o
        out[g.token_index] = o
    return out


def table_slots(tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[B, max_blocks] block tables -> [B, length] slot ids of positions 0..length-1."""
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[:, :, None] * block_size + offsets).reshape(tables.shape[0], -1)[:, :length]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows `slots` [B, L] of one layer's cache [S, kv_heads, D] -> [B, kv_heads, L, D]."""
    rows = torch.index_select(cache, 0, slots.reshape(-1))
    return rows.view(slots.shape[0], slots.shape[1], cache.shape[1], cache.shape[2]).transpose(1, 2)


class _Weights:
    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"no *.safetensors in {model_dir}")
        self._tensors: dict[str, torch.Tensor] = {}
        for path in files:
            for name, tensor in load_file(str(path)).items():
                self._tensors[name.removeprefix("transformer.")] = tensor

    def get(self, name: str, dtype: torch.dtype, device: str, transpose: bool = False) -> torch.Tensor:
        if name not in self._tensors:
            raise ConfigError(f"weight {name!r} missing from the checkpoint")
        tensor = self._tensors[name]
        tensor = tensor.t() if transpose else tensor
        return tensor.to(device=device, dtype=dtype).contiguous()

    def has(self, name: str) -> bool:
        return name in self._tensors


class CausalLM(Protocol):
    def forward(self, inp: ForwardInput, cache: KVCache) -> torch.Tensor:
        """Logits [N, vocab] (float32) for the rows in `inp.logits_index`."""
        ...


def load_model(model_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: str) -> CausalLM:
    from sluice.engines.generative.architectures import GPT2Model, LlamaModel

    weights = _Weights(model_dir)
    if spec.arch == "gpt2":
        return GPT2Model(spec, weights, dtype, device)
    return LlamaModel(spec, weights, dtype, device)


def rope_tables(spec: ModelSpec, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, [max_model_len, head_dim], float32 (as transformers computes them)."""
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim))
    if spec.rope_scaling is not None:
        inv_freq = spec.rope_scaling.apply(inv_freq)
    positions = torch.arange(spec.max_model_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def softmax_scale(spec: ModelSpec, layer: int) -> float:
    scale = 1.0 / math.sqrt(spec.head_dim)
    return scale / (layer + 1) if spec.scale_by_layer else scale
