"""Next-token choice for a batch of rows: greedy, temperature, top-k, top-p, seeds.

Greedy rows never touch a random generator. A row with a `seed` owns a `torch.Generator` that
lives as long as its request (`forget` drops it), so a seeded request draws the same tokens
whatever else is batched with it. Logit processors (min_tokens, repetition penalty) run only on
the rows that ask for them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from sluice.engines.generative.sequence import SamplingParams

__all__ = ["SampleRow", "Sampler"]


@dataclass(frozen=True, slots=True)
class SampleRow:
    request_id: str
    params: SamplingParams
    token_ids: Seq[int]
    """The sequence's tokens so far (prompt + output), for the repetition penalty."""
    num_output_tokens: int
    blocked_until_min: tuple[int, ...]
    """Token ids (EOS, stop ids) that may not be sampled before `min_tokens` outputs."""


class Sampler:
    def __init__(self, device: str) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> list[int]:
        self._process(logits, rows)
        if all(row.params.is_greedy for row in rows):
            return logits.argmax(dim=-1).tolist()
        chosen = logits.argmax(dim=-1)
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        index = torch.tensor(sampled, device=logits.device)
        probs = self._probabilities(logits[index], [rows[i].params for i in sampled])
        for j, i in enumerate(sampled):
            chosen[i] = torch.multinomial(probs[j], 1, generator=self._generator(rows[i])).squeeze()
        return chosen.tolist()

    def _process(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> None:
        for i, row in enumerate(rows):
            if row.num_output_tokens < row.params.min_tokens and row.blocked_until_min:
                logits[i, list(row.blocked_until_min)] = -torch.inf
            penalty = row.params.repetition_penalty
            if penalty != 1.0:
                ids = torch.tensor(sorted(set(row.token_ids)), device=logits.device, dtype=torch.long)
                seen = logits[i, ids]
                logits[i, ids] = torch.where(seen < 0, seen * penalty, seen / penalty)

    def _probabilities(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
        logits = logits / temps[:, None]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
        ordered, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        ordered = ordered.masked_fill(ranks >= top_k[:, None], -torch.inf)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        beyond_p = (cumulative - ordered.softmax(dim=-1)) >= top_p[:, None]  # the first token always stays
        ordered = ordered.masked_fill(beyond_p, -torch.inf)
        return torch.full_like(logits, -torch.inf).scatter(-1, order, ordered).softmax(dim=-1)

    def _generator(self, row: SampleRow) -> torch.Generator | None:
        if row.params.seed is None:
            return None
        generator = self._generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(row.params.seed)
            self._generators[row.request_id] = generator
        return generator
