"""A reasoning model's thoughts, answered apart from its answer (what vLLM's `--reasoning-parser` does).

A model that thinks before it answers writes its thoughts between `<think>` and `</think>`. Its
`model.toml` names how with `reasoning_parser` in `[params]`:

    deepseek_r1   the output starts in the thoughts (the chat template opened them) and they end
                  at `</think>`; a `<think>` the output starts with is dropped; with no `</think>`,
                  all of it is thought (cut by max_tokens while thinking)
    qwen3         thoughts only when the output starts with `<think>` (Qwen3 thinks unless the
                  request's `chat_template_kwargs` say `enable_thinking: false`); otherwise all of
                  it is the answer

Chat answers carry the thoughts as the message's `reasoning_content` (DeepSeek's and vLLM's name)
and `reasoning` (vLLM's newer one), and stream them as deltas of both; the answer is `content`,
which is what tool calls are read from. Responses answers carry them as a `reasoning` output item.
A JSON answer (a structured output, tool calls asked for) may come after thoughts, which its
grammar leaves free; a regular expression, choice or grammar holds the whole output, so it is read
as qwen3's: thoughts only where it tags them. Nothing is trimmed: thoughts and answer are the
output's text on either side of the tags, so a stream's pieces join into the unstreamed answer's.
"""

from __future__ import annotations

from sluice import wire

PARSERS = ("deepseek_r1", "qwen3")
"""The `reasoning_parser`s a model may name."""
OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    """One choice's output, piece by piece, as (thoughts, answer) pieces. Text that may be the
    start of a tag is held back until the next piece (or the end) says whether it is one."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.parser = parser
        self.phase = "start"
        """"start" (not known yet), "thinking" or "answer"."""
        self.has_thought = False
        """The output has been in its thoughts."""
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The thoughts and the answer in `text` (after what was held back) that can be told now."""
        text, self._held = self._held + text, ""
        if self.phase == "start":
            if len(text) < len(OPEN) and OPEN.startswith(text):
                self._held = text
                return "", ""
            if text.startswith(OPEN):
                text, self.phase, self.has_thought = text[len(OPEN):], "thinking", True
            else:
                self.phase = self._untagged()
                self.has_thought = self.phase == "thinking"
        if self.phase == "answer":
            return "", text
        end = text.find(CLOSE)
        if end < 0:
            keep = _partial_tag(text, CLOSE)
            self._held = text[len(text) - keep:]
            return text[:len(text) - keep], ""
        self.phase = "answer"
        return text[:end], text[end + len(CLOSE):]

    def finish(self) -> tuple[str, str]:
        """What was held back, at the output's end: never a tag after all."""
        held, self._held = self._held, ""
        if self.phase == "start":
            self.phase = self._untagged()
            self.has_thought = self.phase == "thinking"
        return (held, "") if self.phase == "thinking" else ("", held)

    def last(self, text: str) -> tuple[str, str]:
        """`feed` of the output's last piece, then `finish`."""
        thought, answer = self.feed(text)
        held_thought, held_answer = self.finish()
        return thought + held_thought, answer + held_answer

    def _untagged(self) -> str:
        """The phase of an output that does not open with `<think>`."""
        return "thinking" if self.parser == "deepseek_r1" else "answer"


def thought_fields(thought: str | None) -> dict[str, str | None]:
    """A chat message's or delta's thoughts, under both names clients read."""
    return {"reasoning_content": thought, "reasoning": thought}


def request_parser(model_parser: str, payload: wire.GeneratePayload) -> str:
    """The parser of one request to a model with `model_parser`: only a chat's answer is read apart
    (a completion is answered whole: ""). A JSON answer (a JSON schema or
    object, tool calls asked for) comes after the thoughts the model's grammar lets it write first
    (`engines.generative.structured.with_thoughts`); any other format holds the whole output from
    its first token, so it cannot have begun in thoughts the template opened: only what it tags is
    thought (qwen3's reading)."""
    if model_parser not in PARSERS or payload.messages is None:  # (an unknown one: a newer worker's)
        return ""
    output_format = payload.output_format
    if output_format is None or output_format.is_json:
        return model_parser
    return "qwen3"


class ThoughtTokens:
    """How many of an output's tokens are thought (usage's `reasoning_tokens`), counted piece by
    piece as the worker generates them: those that came while the output was in its thoughts. A
    tag that is a token of its own (as `<think>` and `</think>` are in Qwen3's and DeepSeek-R1's
    vocabularies) is not thought, as vLLM counts them; a tag spelt in several tokens, by a model
    without them, is counted with the thoughts. `spent` counts the tags too: the tokens before the
    answer."""

    def __init__(self, parser: str) -> None:
        self._splitter = ReasoningSplitter(parser)
        self._undecided = 0  # tokens before the output says whether it opens with thoughts
        self.count = 0
        self.spent = 0

    def add(self, text: str, num_tokens: int) -> None:
        before = self._splitter.phase
        self._splitter.feed(text)
        is_tag = num_tokens == 1 and text in (OPEN, CLOSE) and before != "answer"
        self._settle(before, num_tokens, 0 if is_tag else num_tokens)

    def finish(self) -> int:
        """The count, once the output has ended."""
        before = self._splitter.phase
        self._splitter.finish()
        self._settle(before, 0, 0)
        return self.count

    def _settle(self, before: str, num_tokens: int, thought_tokens: int) -> None:
        """Count a piece that came in thoughts, or that opened them (with the pieces before it
        that could not yet tell), or that opened and closed them at once."""
        after = self._splitter.phase
        if after == "start":
            self._undecided += num_tokens
            return
        if before == "thinking" or after == "thinking" or (before == "start" and self._splitter.has_thought):
            self.count += self._undecided + thought_tokens
            self.spent += self._undecided + num_tokens
        self._undecided = 0


def thought_token_count(parser: str, tokens: list[str]) -> int:
    """How many of an output's tokens (their texts, in order) come before its answer: its
    thoughts and their tags (`ThoughtTokens.spent`)."""
    counter = ThoughtTokens(parser)
    for token in tokens:
        counter.add(token, 1)
    counter.finish()
    return counter.spent


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole output's (thoughts, answer); thoughts None when it has none."""
    thought, answer = ReasoningSplitter(parser).last(text)
    return thought or None, answer


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (shorter than it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
