"""`tiny-lm`: a small random-weight Llama-architecture model, generated deterministically, offline.

Sized so that CPU decoding of 32 sequences is a real workload yet fast: 6 layers, hidden 384,
6 query / 2 KV heads of 64 (GQA, as in current Llama/Qwen checkpoints), SwiGLU 1024, a 2,048-token
byte-level BPE vocabulary, tied embeddings: about 10 M parameters (40 MB in float32), a decode step
at batch 32 costs milliseconds on two cores, and every code path of the real architectures runs.

The tokenizer is trained here with the `tokenizers` library on a corpus built from a fixed word
list and a seeded `random.Random`, so it needs nothing from the network. Everything written is a
pure function of `seed`: two runs give byte-identical files (see tests), so a SHA256SUMS can pin them.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["TINY_LM_CONFIG", "build_tokenizer", "make_tiny_lm"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_LM_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 384,
    "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORD_TEXT = (
    "the a of to and in is it that for on with as was at by be this from or have an they which one you were "
    "her all she there would their we him been has when who will more no if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three request token batch device queue deadline "
    "model serve tenant cache block prefix decode prefill stream server worker gateway latency throughput "
    "über café naïve 東京 数据 模型 🙂 ünïcödé"
)
_WORDS = _WORD_TEXT.split()


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ";", ":"]))
    lines += [f"{n} + {n + 1} = {2 * n + 1}" for n in range(200)]
    return lines


def build_tokenizer(vocab_size: int = 2048, seed: int = 0) -> Tokenizer:
    """A byte-level BPE trained on the built-in corpus; ids 0-3 are the special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    return tokenizer


def _weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    q = config["num_attention_heads"] * config["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": normal(q, hidden), p + "self_attn.k_proj.weight": normal(kv, hidden),
            p + "self_attn.v_proj.weight": normal(kv, hidden), p + "self_attn.o_proj.weight": normal(hidden, q),
            p + "mlp.gate_proj.weight": normal(inter, hidden), p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        }
    return tensors


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def make_tiny_lm(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write tiny-lm into `out_dir` (created if needed) and return it. `overrides` replace entries of
    its config.json (a bigger random-weight Llama for GPU benchmarks, say: `hidden_size=2048, ...`);
    `torch_dtype` also sets the dtype the weights are stored in."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_LM_CONFIG) | overrides
    tokenizer = build_tokenizer(config["vocab_size"], seed)
    config["vocab_size"] = tokenizer.get_vocab_size()
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 0})
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": config["max_position_embeddings"],
    })
    dtype = getattr(torch, config["torch_dtype"])
    weights = {name: t.to(dtype) for name, t in _weights(config, seed).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def ensure_tiny_lm(out_dir: Path, seed: int = 0) -> Path:
    """Generate tiny-lm into `out_dir` unless it is already there. Safe when several workers start
    at once: each writes a private folder and renames it into place; the first rename wins."""
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        make_tiny_lm(scratch, seed)
        try:
            scratch.rename(out_dir)
        except OSError:  # another worker got there first
            if not (out_dir / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir
