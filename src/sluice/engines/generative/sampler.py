"""Next-token choice for a batch of rows: greedy, temperature, top-k, top-p, min-p, seeds; log-probabilities.

Greedy rows never touch a random generator. A row with a `seed` owns a `torch.Generator` that
lives as long as its request (`forget` drops it), so a seeded request draws the same tokens
whatever else is batched with it. Logit processors (min_tokens, logit bias, repetition, presence
and frequency penalties, a structured output's allowed tokens, last) run only on the rows that
ask for them.

A row that asks for log-probabilities gets them from the model's own distribution, taken before
any processor or temperature changes it (what vLLM reports by default): the chosen token's and
the k most likely tokens'. They cost one log-softmax and one top-k over those rows only.

A row whose values break sampling (a bug that let bad input through) gets None instead of a
token, and is logged; the other rows of the batch still get theirs. Temperatures below
`GREEDY_BELOW_TEMPERATURE` are greedy, and sampling runs in float32, so no temperature a client
may send overflows the logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from sluice.engines.generative.sequence import SamplingParams, TokenLogprobs

__all__ = ["SampleRow", "Sampled", "Sampler"]

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
    allowed: np.ndarray | None = None
    """A structured output's grammar: the tokens it allows next, as bits (`structured.masks`)."""


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    logprobs: TokenLogprobs | None = None
    """Only for a row whose parameters ask for them."""


class Sampler:
    def __init__(self, device: str) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> list[Sampled | None]:
        """One token per row (`logits[i]` is row i's); None for a row that could not be sampled.
        The device is synchronised once, when the tokens are read back."""
        raw = self._raw_logprobs(logits, rows)  # before the processors change the logits in place
        is_usable = [self._process(logits, i, row) for i, row in enumerate(rows)]
        _mask_disallowed(logits, rows, is_usable)
        chosen = logits.argmax(dim=-1)
        sampled = [i for i, row in enumerate(rows) if is_usable[i] and not row.params.is_greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            drawn, is_valid = self._draw(logits, [rows[i] for i in sampled], sampled)
            chosen[index] = drawn
            for i, ok in zip(sampled, is_valid.tolist(), strict=True):
                is_usable[i] = is_usable[i] and ok
        reported = self._report(raw, chosen, rows) if raw is not None else {}
        return [Sampled(token, reported.get(i)) if is_usable[i] else None for i, token in enumerate(chosen.tolist())]

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: Seq[SampleRow]) -> tuple[list[int], torch.Tensor] | None:
        """The rows that ask for log-probabilities, and the model's log-softmax over theirs."""
        indices = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not indices:
            return None
        picked = logits[torch.tensor(indices, device=logits.device)].float()
        return indices, picked.log_softmax(dim=-1)

    @staticmethod
    def _report(raw: tuple[list[int], torch.Tensor], chosen: torch.Tensor, rows: Seq[SampleRow]
                ) -> dict[int, TokenLogprobs]:
        """Each asking row's chosen token's log-probability and its top k, by row."""
        indices, logprobs = raw
        tokens = chosen[torch.tensor(indices, device=chosen.device)].tolist()
        found = _logprobs_of(logprobs, tokens, [rows[i].params.logprobs or 0 for i in indices])
        return dict(zip(indices, found, strict=True))

    @staticmethod
    @torch.inference_mode()
    def prompt_logprobs(logits: torch.Tensor, targets: Seq[int], k: int) -> list[TokenLogprobs]:
        """Prompt tokens' log-probabilities: `logits[i]` is the model's prediction of `targets[i]`."""
        logprobs = logits.float().log_softmax(dim=-1)
        return _logprobs_of(logprobs, list(targets), [k] * len(targets))

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
            params = row.params
            if params.logit_bias:
                biased = [token for token, _ in params.logit_bias]
                if not all(0 <= t < vocab for t in biased):
                    raise IndexError(f"a logit_bias token id is outside the vocabulary of {vocab}")
                biases = torch.tensor([bias for _, bias in params.logit_bias], device=logits.device)
                logits[i, biased] += biases.to(logits.dtype)
            if params.presence_penalty or params.frequency_penalty:
                _penalize_outputs(logits, i, row, vocab)
            penalty = params.repetition_penalty
            if penalty != 1.0:
                seen_ids = sorted(set(row.token_ids))
                if seen_ids and not 0 <= seen_ids[0] <= seen_ids[-1] < vocab:
                    raise IndexError(f"a token id is outside the vocabulary of {vocab}")
                ids = torch.tensor(seen_ids, device=logits.device, dtype=torch.long)
                seen = logits[i, ids]
                logits[i, ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
            if row.allowed is not None and not row.allowed.any():
                raise ValueError("its grammar allows no token at all")
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
        if any(p.min_p > 0 for p in params):  # relative to the top token, which top-k and top-p keep
            min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
            kept = ordered.softmax(dim=-1)
            ordered = ordered.masked_fill(kept < min_p[:, None] * kept[:, :1], -torch.inf)
        return torch.full_like(logits, -torch.inf).scatter(-1, order, ordered).softmax(dim=-1)

    def _generator(self, row: SampleRow) -> torch.Generator | None:
        if row.params.seed is None:
            return None
        generator = self._generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(row.params.seed)
            self._generators[row.request_id] = generator
        return generator


def _mask_disallowed(logits: torch.Tensor, rows: Seq[SampleRow], is_usable: list[bool]) -> None:
    """Every token a row's grammar does not allow next gets -inf, for all constrained rows at once:
    their bitmasks go to the device packed and are unpacked there."""
    constrained = [i for i, row in enumerate(rows) if row.allowed is not None and is_usable[i]]
    if not constrained:
        return
    packed = torch.from_numpy(np.stack([rows[i].allowed for i in constrained]))  # type: ignore[misc]
    packed = packed.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(constrained), -1)[:, :logits.shape[-1]].bool()
    index = torch.tensor(constrained, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, -torch.inf)


def _logprobs_of(logprobs: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row i's log-probability of `token_ids[i]` and its `ks[i]` most likely tokens'; the device is
    read back once for all rows."""
    targets = torch.tensor(token_ids, device=logprobs.device, dtype=torch.long)
    picked = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    k = min(max(ks, default=0), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k > 0:
        best = logprobs.topk(k, dim=-1)
        top_values, top_ids = best.values.tolist(), best.indices.tolist()
    return [TokenLogprobs(token_id, picked[i], tuple(zip(top_ids[i][:ks[i]], top_values[i][:ks[i]], strict=True)))
            for i, token_id in enumerate(token_ids)]


def _penalize_outputs(logits: torch.Tensor, i: int, row: SampleRow, vocab: int) -> None:
    """OpenAI's presence and frequency penalties over the tokens generated so far (not the prompt):
    a token's logit loses `presence` once it has appeared and `frequency` per appearance."""
    outputs = row.token_ids[len(row.token_ids) - row.num_output_tokens:] if row.num_output_tokens else []
    if not outputs:
        return
    if not (min(outputs) >= 0 and max(outputs) < vocab):  # checked here: on CUDA it would be a device assert
        raise IndexError(f"a token id is outside the vocabulary of {vocab}")
    ids, counts = torch.tensor(outputs, device=logits.device, dtype=torch.long).unique(return_counts=True)
    params = row.params
    logits[i, ids] -= (params.presence_penalty + params.frequency_penalty * counts).to(logits.dtype)
