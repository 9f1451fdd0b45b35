"""The two supported layer stacks, written against `model.attention` and the flattened batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.engines.generative.model import (
    ForwardInput,
    KVCache,
    ModelSpec,
    _Weights,
    attention,
    rope_tables,
    softmax_scale,
)

__all__ = ["GPT2Model", "LlamaModel"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers computes it: normalised in float32, scaled in the model's dtype. torch's
    `rms_norm` is one fused kernel on CUDA (on the CPU it runs the same few ops as before)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers computes it, x * cos + rotate_half(x) * sin, in four kernels: with
    halves (x1, x2), rotate_half(x) = (-x2, x1) = roll(x, half) * (-1, +1), and the sign is folded
    into `signed_sin` = (-sin1, sin2) once (a negation is exact, so the products are the same)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


def signed(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


@dataclass(slots=True)
class _LlamaLayer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [heads + kv heads, head_dim]: each query head's weights, then each key head's
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # a dense MLP's; a mixture's: [experts, 2 * intermediate, hidden]
    down: torch.Tensor  # a dense MLP's; a mixture's: [experts, hidden, intermediate]
    router: torch.Tensor | None = None  # a mixture of experts' router, [experts, hidden]; None: dense


class LlamaModel:
    def __init__(self, spec: ModelSpec, w: _Weights, dtype: torch.dtype, device: str) -> None:
        self.spec = spec
        self.embed = w.get("model.embed_tokens.weight", dtype, device)
        self.norm = w.get("model.norm.weight", dtype, device)
        tied = spec.tie_word_embeddings or not w.has("lm_head.weight")
        self.lm_head = self.embed if tied else w.get("lm_head.weight", dtype, device)
        cos, sin = rope_tables(spec, device)
        self.cos, self.signed_sin = cos.to(dtype), signed(sin).to(dtype)
        self.layers = [self._layer(spec, w, i, dtype, device) for i in range(spec.num_layers)]

    @staticmethod
    def _layer(spec: ModelSpec, w: _Weights, i: int, dtype: torch.dtype, device: str) -> _LlamaLayer:
        p = f"model.layers.{i}."

        def get(name: str) -> torch.Tensor:
            return w.get(p + name, dtype, device)

        qkv = torch.cat([get(f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = None
        if w.has(p + "self_attn.q_proj.bias"):
            bias = torch.cat([get(f"self_attn.{n}_proj.bias") for n in "qkv"])
        qk_norm = None
        if spec.qk_norm:  # one weight row per head, so both norms are one kernel over the rotated heads
            qk_norm = torch.cat([get("self_attn.q_norm.weight").expand(spec.num_heads, -1),
                                 get("self_attn.k_norm.weight").expand(spec.num_kv_heads, -1)]).contiguous()
        if i in spec.moe_layers:
            router, gate_up, down = _expert_weights(spec, w, p, dtype, device)
        else:
            router, down = None, get("mlp.down_proj.weight")
            gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
        return _LlamaLayer(get("input_layernorm.weight"), qkv, bias, qk_norm, get("self_attn.o_proj.weight"),
                           get("post_attention_layernorm.weight"), gate_up, down, router)

    @torch.inference_mode()
    def forward(self, inp: ForwardInput, cache: KVCache) -> torch.Tensor:
        s = self.spec
        num_tokens = inp.input_ids.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        cos, sin = self.cos[inp.positions][:, None, :], self.signed_sin[inp.positions][:, None, :]
        x = self.embed[inp.input_ids]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, s.norm_eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            qk = qkv[:, :q_size + kv_size].view(num_tokens, s.num_heads + s.num_kv_heads, s.head_dim)
            if layer.qk_norm is not None:
                qk = rms_norm(qk, layer.qk_norm, s.norm_eps)
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]  # rotated together: one set of kernels
            v = qkv[:, q_size + kv_size:].view(num_tokens, s.num_kv_heads, s.head_dim)
            a = attention(q, k, v, i, cache, inp, softmax_scale(s, i))
            x = x + F.linear(a.view(num_tokens, q_size), layer.o)
            h = rms_norm(x, layer.post_norm, s.norm_eps)
            if layer.router is not None:
                x = x + mixture_of_experts(h, layer, s)
            else:
                gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
                x = x + F.linear(F.silu(gate) * up, layer.down)
        x = rms_norm(x[inp.logits_index], self.norm, s.norm_eps)
        return F.linear(x, self.lm_head).float()


def _expert_weights(spec: ModelSpec, w: _Weights, p: str, dtype: torch.dtype,
                    device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixture's router and its experts' weights stacked: as checkpoints keep them, one expert
    at a time (Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`, Qwen3-MoE's
    `mlp.experts.N.gate_proj/up_proj/down_proj`), or already stacked (`mlp.experts.gate_up_proj`)."""
    block = "block_sparse_moe." if w.has(p + "block_sparse_moe.gate.weight") else "mlp."
    router = w.get(p + block + "gate.weight", dtype, device)
    experts = p + block + "experts."
    if w.has(experts + "gate_up_proj"):
        return router, w.get(experts + "gate_up_proj", dtype, device), w.get(experts + "down_proj", dtype, device)
    names = ("w1", "w3", "w2") if block == "block_sparse_moe." else ("gate_proj", "up_proj", "down_proj")
    gate_up = torch.stack([torch.cat([w.get(f"{experts}{e}.{names[0]}.weight", dtype, device),
                                      w.get(f"{experts}{e}.{names[1]}.weight", dtype, device)])
                           for e in range(spec.num_experts)])
    down = torch.stack([w.get(f"{experts}{e}.{names[2]}.weight", dtype, device) for e in range(spec.num_experts)])
    return router, gate_up, down


def mixture_of_experts(h: torch.Tensor, layer: _LlamaLayer, spec: ModelSpec) -> torch.Tensor:
    """Each token [T, hidden] through its top k experts by the router's probabilities (computed
    in float32; the k renormalised where the model does; cast to the model's dtype where it does),
    their outputs weighed by them and summed expert by expert in the experts' order, as
    transformers sums them. Only the experts some token chose run, each on its tokens alone;
    finding them reads the choice back to the host, so a mixture's decode steps are not captured
    as CUDA graphs (`ModelRunner.use_decode_graphs`)."""
    assert layer.router is not None
    probs = torch.softmax(F.linear(h, layer.router).float(), dim=-1)
    weights, chosen = torch.topk(probs, spec.experts_per_token, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.router_weights_in_model_dtype:
        weights = weights.to(h.dtype)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, rank) pairs grouped by expert, in token order
    counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
    flat_weights = weights.reshape(-1)
    out = torch.zeros_like(h)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // spec.experts_per_token
        gate, up = F.linear(h[tokens], layer.gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, layer.down[expert])
        out.index_add_(0, tokens, (y * flat_weights[pairs, None]).to(h.dtype))
    return out


@dataclass(slots=True)
class _GPT2Layer:
    ln_1: tuple[torch.Tensor, torch.Tensor]
    c_attn: tuple[torch.Tensor, torch.Tensor]
    c_proj: tuple[torch.Tensor, torch.Tensor]
    ln_2: tuple[torch.Tensor, torch.Tensor]
    c_fc: tuple[torch.Tensor, torch.Tensor]
    mlp_proj: tuple[torch.Tensor, torch.Tensor]


class GPT2Model:
    def __init__(self, spec: ModelSpec, w: _Weights, dtype: torch.dtype, device: str) -> None:
        self.spec = spec
        self.wte = w.get("wte.weight", dtype, device)
        self.wpe = w.get("wpe.weight", dtype, device)
        self.ln_f = (w.get("ln_f.weight", dtype, device), w.get("ln_f.bias", dtype, device))
        self.layers = [self._layer(w, f"h.{i}.", dtype, device) for i in range(spec.num_layers)]

    @staticmethod
    def _layer(w: _Weights, p: str, dtype: torch.dtype, device: str) -> _GPT2Layer:
        def pair(name: str, conv1d: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            # HF's Conv1D stores weights as [in, out]; F.linear wants [out, in]
            weight = w.get(p + name + ".weight", dtype, device, transpose=conv1d)
            return weight, w.get(p + name + ".bias", dtype, device)

        return _GPT2Layer(pair("ln_1"), pair("attn.c_attn", True), pair("attn.c_proj", True), pair("ln_2"),
                          pair("mlp.c_fc", True), pair("mlp.c_proj", True))

    @torch.inference_mode()
    def forward(self, inp: ForwardInput, cache: KVCache) -> torch.Tensor:
        s = self.spec
        num_tokens, hidden = inp.input_ids.shape[0], s.hidden_size
        x = self.wte[inp.input_ids] + self.wpe[inp.positions]
        for i, layer in enumerate(self.layers):
            h = F.layer_norm(x, (hidden,), *layer.ln_1, eps=s.norm_eps)
            q, k, v = F.linear(h, *layer.c_attn).split(hidden, dim=-1)
            shape = (num_tokens, s.num_heads, s.head_dim)
            a = attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), i, cache, inp, softmax_scale(s, i))
            x = x + F.linear(a.view(num_tokens, hidden), *layer.c_proj)
            h = F.layer_norm(x, (hidden,), *layer.ln_2, eps=s.norm_eps)
            x = x + F.linear(gelu_new(F.linear(h, *layer.c_fc)), *layer.mlp_proj)
        x = F.layer_norm(x[inp.logits_index], (hidden,), *self.ln_f, eps=s.norm_eps)
        return F.linear(x, self.wte).float()
