"""Next-token choice for a batch of rows: greedy, temperature, top-k, top-p, seeds.

Greedy rows never touch a random generator. A row with a `seed` owns a `torch.Generator` that
lives as long as its request (`forget` drops it), so a seeded request draws the same tokens
whatever else is batched with it. Logit processors (min_tokens, repetition penalty) run only on
the rows that ask for them.

A row whose values break sampling (a bug that let bad input through) gets None instead of a
token, and is logged; the other rows of the batch still get theirs. Temperatures below
`GREEDY_BELOW_TEMPERATURE` are greedy, and sampling runs in float32, so no temperature a client
may send overflows the logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from sluice.engines.generative.sequence import SamplingParams

__all__ = ["SampleRow", "Sampler"]

log = logging.getLogger("sluice.engine")


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
    def sample(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> list[int | None]:
        """One token per row (`logits[i]` is row i's); None for a row that could not be sampled.
        The device is synchronised once, when the tokens are read back."""
        is_usable = [self._process(logits, i, row) for i, row in enumerate(rows)]
        chosen = logits.argmax(dim=-1)
        sampled = [i for i, row in enumerate(rows) if is_usable[i] and not row.params.is_greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            drawn, is_valid = self._draw(logits, [rows[i] for i in sampled], sampled)
            chosen[index] = drawn
            for i, ok in zip(sampled, is_valid.tolist(), strict=True):
                is_usable[i] = is_usable[i] and ok
        return [token if is_usable[i] else None for i, token in enumerate(chosen.tolist())]

    def _process(self, logits: torch.Tensor, i: int, row: SampleRow) -> bool:
        """Apply row i's logit processors in place; False if they cannot (the row is not sampled).
        Token ids are checked against the vocabulary first: an out-of-range index is an exception
        on the CPU but a device assert on CUDA."""
        vocab = logits.shape[-1]
        try:
            if row.num_output_tokens < row.params.min_tokens and row.blocked_until_min:
                if not all(0 <= t < vocab for t in row.blocked_until_min):
                    raise IndexError(f"a stop token id is outside the vocabulary of {vocab}")
                logits[i, list(row.blocked_until_min)] = -torch.inf
            penalty = row.params.repetition_penalty
            if penalty != 1.0:
                seen_ids = sorted(set(row.token_ids))
                if seen_ids and not 0 <= seen_ids[0] <= seen_ids[-1] < vocab:
                    raise IndexError(f"a token id is outside the vocabulary of {vocab}")
                ids = torch.tensor(seen_ids, device=logits.device, dtype=torch.long)
                seen = logits[i, ids]
                logits[i, ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
        except Exception:
            log.exception("request %s: its logit processors failed; ending it", row.request_id)
            return False
        return True

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow], indices: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random draws for the non-greedy rows (`indices` into `logits`), and whether each row's
        probabilities were a distribution. A row that is not (NaN, inf, all zero) is never handed
        to `multinomial` as it is (on CUDA that is a device assert, fatal to every sequence): it
        draws from a placeholder and is reported invalid."""
        try:
            probs = self._probabilities(logits[torch.tensor(indices, device=logits.device)], [r.params for r in rows])
        except Exception:
            if len(rows) == 1:
                log.exception("request %s: sampling failed; ending it", rows[0].request_id)
                return logits[indices[0]].argmax().view(1), torch.zeros(1, dtype=torch.bool, device=logits.device)
            log.exception("sampling failed for a batch of %d rows; retrying them one by one", len(rows))
            parts = [self._draw(logits, [row], [i]) for i, row in zip(indices, rows, strict=True)]
            return torch.cat([t for t, _ in parts]), torch.cat([v for _, v in parts])
        is_valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
        probs = torch.where(is_valid[:, None], probs, torch.ones_like(probs))
        drawn = torch.cat([torch.multinomial(probs[j], 1, generator=self._generator(row))
                           for j, row in enumerate(rows)])
        return drawn, is_valid

    def _probabilities(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[-1]
        logits = logits.float()  # a low temperature must not overflow a half-precision logit
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
