"""Text in and out: `tokenizer.json` via the `tokenizers` library, incremental detokenization,
stop strings, EOS ids and chat templates. Nothing here downloads anything.

Incremental detokenization keeps two offsets into the token list:

    tokens   [ ... context ... | prefix_offset ... read_offset | new ... ]
    delta  = decode(tokens[prefix:]) minus decode(tokens[prefix:read])

so a token that only completes a multi-byte character (decoded as U+FFFD until then) is held back
until it does, and word-boundary spaces come out right because the window has left context. When
the sequence ends (`max_tokens`, EOS, a grammar's end) with a character still incomplete, `flush`
gives what is held back as decoding the ids gives it: U+FFFD for the incomplete character. (vLLM's
detokenizers drop those bytes: the text then ends short of its tokens, and a client that counts
them, or decodes the ids itself, disagrees with it.)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from sluice import wire
from sluice.errors import ConfigError

__all__ = ["DEFAULT_CHAT_TEMPLATE", "MESSAGE_CHARS", "Detokenizer", "StopChecker", "Tokenizer", "prompt_chars"]

DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{{ m.tool_calls | tojson if m.tool_calls else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Used when the model folder has no `chat_template`: the tools (if any) as JSON, then each
message as `<|role|>\\ncontent\\n`, an assistant's tool calls as JSON after its content."""
MESSAGE_CHARS = 16
"""What a chat template writes around each message, at least (`<|im_start|>user\n` ... `<|im_end|>\n`
is 25 characters; sluice's default template's `<|user|>\n` ... `\n`, 10); at least one token."""

_GIL_FREE_ENCODE_CHARS = 4096
"""Longer texts are encoded with the GIL released, so tokenizing one on a worker thread does not
stall the event loop's thread."""


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template: str = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        self.bos_token: str = _token_text(config.get("bos_token")) or ""
        self.eos_token: str = _token_text(config.get("eos_token")) or ""
        self.eos_token_ids = _eos_ids(model_dir)
        self.vocab_size = self._tok.get_vocab_size()
        self._texts: dict[int, str] = {}

    def to_json(self) -> str:
        """The whole tokenizer as `tokenizer.json` text (for `structured.Grammars`)."""
        return str(self._tok.to_str())

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included (for log-probability reports; a token
        holding part of a character decodes to U+FFFD). Kept once decoded: at most a vocabulary."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes of a token that holds part of a character (its text alone has U+FFFD where
        they are), read from its vocabulary entry: a byte-level BPE's (GPT-2's byte alphabet) or
        a byte-fallback piece (`<0xE2>`). None where its text's UTF-8 is its bytes, or where the
        entry is in neither form."""
        if "\ufffd" not in self.token_text(token_id):
            return None
        piece = self._tok.id_to_token(token_id) or ""
        # A byte-fallback piece first: its characters are in GPT-2's alphabet too.
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        if piece and all(ch in _BYTE_OF_CHAR for ch in piece):
            return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_ENCODE_CHARS:  # `encode` holds the GIL throughout; `encode_batch` lets go
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Seq[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """The template's text; `kwargs` are more variables for it (`enable_thinking`, say).
        `continue_final_message`: the text ends where the last message's content does, so the
        model continues that message (ValueError if the template does not write it as sent)."""
        text: str = self._compiled_template().render(
            {**kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools,
             "bos_token": self.bos_token, "eos_token": self.eos_token})
        if continue_final_message:
            final = messages[-1].get("content") or ""
            end = text.rfind(final) if final.strip() else -1
            if end < 0:
                raise ValueError("continue_final_message: the chat template does not write the last message's "
                                 "content as sent, so there is no place to continue it from")
            text = text[:end + len(final)]
        return text

    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads (those it does not set itself), e.g. `reasoning_effort`."""
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return frozenset(meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(self.chat_template)))

    @functools.cache  # noqa: B019 - one per tokenizer, which lives as long as its model
    def _compiled_template(self) -> Any:
        """Compiling a template takes milliseconds; it is done once, not on every chat request."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(self.chat_template)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in its vocabulary
    (printable bytes stand for themselves; the others are shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in chars)
    chars.update({byte: chr(256 + i) for i, byte in enumerate(shifted)})
    return {char: byte for byte, char in chars.items()}


_BYTE_OF_CHAR = _byte_alphabet()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _eos_ids(model_dir: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        if value is not None:
            return tuple(value) if isinstance(value, list) else (int(value),)
    return ()


class Detokenizer:
    """One sequence's output text, produced a delta at a time."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Seq[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-6:])  # left context for spacing
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_ids: Seq[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix:], self._skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """The text held back at the end of the sequence: an incomplete character's bytes, as
        U+FFFD (as `Tokenizer.decode` of all the ids writes them)."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""


class StopChecker:
    """Stop strings over a growing text. Holds back a tail that could still become a stop string,
    and strips the stop string itself from the output (keeps it, with `include_stop`). Text pushed
    with `can_stop=False` (the output before `min_tokens`) is never part of a match: a stop string
    must start after it."""

    def __init__(self, stop: Seq[str], include_stop: bool = False) -> None:
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._longest = max((len(s) for s in self._stop), default=0)
        self._text = ""
        self._emitted = 0
        self._floor = 0  # matches start at or after this offset
        self._hold_from = 0  # no stop string can start before this offset (see `_held_back`)

    @property
    def text(self) -> str:
        return self._text

    def push(self, delta: str, can_stop: bool = True) -> tuple[str, bool]:
        """Add decoded text; returns (text safe to emit now, whether a stop string matched)."""
        if not self._stop or not can_stop:
            self._text += delta
            if not can_stop:
                self._floor = len(self._text)
            out = self._text[self._emitted:]
            self._emitted = len(self._text)
            return out, False
        search_from = max(self._floor, len(self._text) - self._longest + 1)
        self._text += delta
        hits = [(i, -len(s)) for s in self._stop if (i := self._text.find(s, search_from)) >= 0]
        if hits:
            at, minus_length = min(hits)  # the first to start; of those, the longest
            self._text = self._text[:at - minus_length if self._include_stop else at]
            return self.flush(), True
        safe = len(self._text) - self._held_back()
        out = self._text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return out, False

    def flush(self) -> str:
        out = self._text[self._emitted:]
        self._emitted = len(self._text)
        return out

    def _held_back(self) -> int:
        """The length of the longest tail that could still become a stop string. An offset whose
        tail is no stop string's start never is again (the text only grows), so each call resumes
        where the last one found a candidate: each offset is ruled out once over the whole text,
        not once per token (long stop strings made that quadratic in the output's length)."""
        start = max(self._hold_from, self._floor, len(self._text) - self._longest + 1)
        for at in range(start, len(self._text)):
            tail = self._text[at:]
            if any(s.startswith(tail) for s in self._stop):
                self._hold_from = at
                return len(self._text) - at
        self._hold_from = len(self._text)
        return 0


def prompt_chars(payload: wire.GeneratePayload | wire.TokenizePayload) -> int:
    """The prompt's length in characters, before any tokenization. Messages: their contents and
    `MESSAGE_CHARS` for each (its role's markers, which the chat template writes), so a
    conversation of many short messages is rendered off the worker's event loop, and refused
    untokenized when it is far too long, as a long text is."""
    if payload.messages is not None:
        return sum(m.num_chars for m in payload.messages) + MESSAGE_CHARS * len(payload.messages)
    return len(payload.prompt or "")
