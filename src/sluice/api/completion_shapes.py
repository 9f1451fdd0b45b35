"""OpenAI's response and chunk objects for one generation request: `/v1/completions`' and
`/v1/chat/completions`' bodies, their streamed chunks, usage and log-probabilities, for n choices
of each of m prompts (choice `j` of prompt `p` is index `p * n + j`, as OpenAI numbers them) and
echoed prompts. Pure: wire values in, JSON-ready dicts out.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Sequence
from typing import Any

from sluice import wire
from sluice.api.tool_calls import ToolPlan, tool_call
from sluice.reasoning import ReasoningSplitter, split_reasoning, thought_fields

__all__ = ["ResponseShape", "usage"]


class ResponseShape:
    """OpenAI's response and chunk objects for one request (m prompts, n choices each)."""

    def __init__(self, is_chat: bool, model: str, include_usage: bool = False, logprobs: int | None = None,
                 prompt_texts: Sequence[str | None] = (None,), n: int = 1, tools: ToolPlan | None = None,
                 is_legacy_functions: bool = False, echo: str = "", continuous_usage: bool = False,
                 return_token_ids: bool = False, response_id: str | None = None, reasoning: str = "") -> None:
        self.is_chat = is_chat
        self.model = model
        self.include_usage = include_usage
        """Streamed chunks carry `"usage": null` until the last one carries the counts."""
        self.continuous_usage = include_usage and continuous_usage
        """vLLM's `stream_options.continuous_usage_stats`: every chunk carries the counts so far."""
        self._prompt_tokens = [0] * len(prompt_texts)  # each prompt's tokens, as its first chunk reports them
        self._output_tokens = [0] * len(prompt_texts)  # each prompt's output tokens (all its choices) so far
        self.logprobs = logprobs
        """The alternatives asked for per token; None: no log-probabilities."""
        self.prompt_texts = list(prompt_texts)
        """Each prompt, if the client sent it as text: an echo repeats it as sent (else as the worker
        decoded its tokens)."""
        self.n = n
        self.num_choices = n * len(self.prompt_texts)
        self.id = response_id or f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        """The response's and its chunks' `id` (`api.common.response_id`: vLLM's `request_id` names it)."""
        self.created = int(time.time())
        self._text_offsets = [0] * self.num_choices  # each choice's token offsets run on across a stream's chunks
        self._decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(self.num_choices)]
        """Each choice's tokens' bytes so far as text: a character split over tokens is counted
        once it is whole, so each of its tokens has its offset."""
        self.tools = tools
        """Chat: the answer is tool calls (`api.tool_calls`), not content."""
        self.is_legacy_functions = is_legacy_functions
        """Chat: the call is answered as a legacy `function_call` (`api.legacy_functions`)."""
        self.echo_text = echo
        """Chat (vLLM's `echo`): each choice's content starts with this, the message it continues."""
        self._calls_text = [""] * self.num_choices  # a stream's required (or auto) calls, sent whole at the end
        self._call_ids: list[str | None] = [None] * self.num_choices  # a stream's named call, once started
        self._held = [""] * self.num_choices  # auto: text that may be the start of a call, not sent yet
        self._shown = [False] * self.num_choices  # auto: some content was sent
        self._texts = [""] * self.num_choices  # auto: the whole text so far
        self._sent = [""] * self.num_choices  # auto: the content sent so far
        self.return_token_ids = return_token_ids
        """vLLM's `return_token_ids`: completions' choices carry `prompt_token_ids` (a stream: its
        first chunk of each) and `token_ids`; chat's response carries `prompt_token_ids` (a stream:
        its first chunk) and its choices `token_ids`. Streamed, a chunk's `token_ids` are the
        tokens since the choice's last chunk (ids whose text is held back go with the next one)."""
        self._prompt_token_ids: list[list[int] | None] = [None] * len(self.prompt_texts)
        self._unsent_ids: list[list[int]] = [[] for _ in range(self.num_choices)]
        self._is_prompt_ids_sent = [False] * self.num_choices  # per choice (completions) or the first (chat)
        self.reasoning = reasoning if is_chat else ""
        """Chat: the model's `reasoning_parser` (`sluice.reasoning`): its thoughts are answered apart
        from its content; "": all of its text is content."""
        self._thinking = [ReasoningSplitter(self.reasoning) for _ in range(self.num_choices)] if self.reasoning else []

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, payloads: Sequence[wire.GenerationResult]) -> dict[str, Any]:
        """The unstreamed response body: each prompt's result, in prompt order."""
        choices = []
        for p, payload in enumerate(payloads):
            first = wire.GeneratedChoice(payload.text, payload.finish_reason, payload.logprobs, payload.token_ids)
            for j, choice in enumerate([first, *payload.choices]):
                answer = self._choice(p * self.n + j, choice, payload.prompt)
                if self.return_token_ids:
                    if not self.is_chat:
                        answer["prompt_token_ids"] = payload.prompt_token_ids
                    answer["token_ids"] = choice.token_ids or []
                choices.append(answer)
        head = self._head("chat.completion" if self.is_chat else "text_completion")
        if self.return_token_ids and self.is_chat:
            head["prompt_token_ids"] = payloads[0].prompt_token_ids if payloads else None
        return {**head, "choices": choices, "usage": usage(payloads, bool(self.reasoning))}

    def _choice(self, index: int, choice: wire.GeneratedChoice, prompt: wire.EchoedPrompt | None) -> dict[str, Any]:
        logprobs = self._logprobs(choice.logprobs or [], prompt, index)
        thought, text = self.thought_and_answer(choice.text)
        thoughts = thought_fields(thought) if self.reasoning else {}
        if self.is_chat and self.tools is not None:
            content, calls = self.answer(text)
            message: dict[str, Any] = {"role": "assistant", "content": content, **thoughts}
            if calls and self.is_legacy_functions:
                message["function_call"] = calls[0]["function"]
            elif calls:
                message["tool_calls"] = calls
            return {"index": index, "message": message, "logprobs": None,
                    "finish_reason": self._finish_reason(choice.finish_reason, calls)}
        if self.is_chat:
            # all thought and no answer (cut by max_tokens while thinking): null, as vLLM's parsers answer
            content = (self.echo_text + text) or (None if thought else "")
            return {"index": index, "message": {"role": "assistant", "content": content, **thoughts},
                    "logprobs": logprobs, "finish_reason": choice.finish_reason}
        text = choice.text if prompt is None else self._prompt_text(prompt, index) + choice.text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def _chunk(self, choice: dict[str, Any], *, has_ids: bool = True) -> dict[str, Any]:
        """A stream's chunk of one choice (`has_ids`: of its output, so it carries `token_ids`)."""
        chunk = {**self._head("chat.completion.chunk" if self.is_chat else "text_completion"), "choices": [choice]}
        if self.return_token_ids:
            self._with_token_ids(chunk, choice, has_ids)
        if self.include_usage:
            chunk["usage"] = self._usage_so_far() if self.continuous_usage else None
        return chunk

    def _with_token_ids(self, chunk: dict[str, Any], choice: dict[str, Any], has_ids: bool) -> None:
        index = choice["index"]
        if self.is_chat:  # the response's, on its first chunk
            if not self._is_prompt_ids_sent[0]:
                self._is_prompt_ids_sent[0] = True
                chunk["prompt_token_ids"] = self._prompt_token_ids[0]
        elif not self._is_prompt_ids_sent[index]:  # each choice's, on its first chunk
            self._is_prompt_ids_sent[index] = True
            choice["prompt_token_ids"] = self._prompt_token_ids[index // self.n]
        if has_ids:
            choice["token_ids"], self._unsent_ids[index] = self._unsent_ids[index], []

    def note_prompt_token_ids(self, p: int, token_ids: list[int] | None) -> None:
        """Prompt `p`'s token ids, as its stream's first chunk reports them (None on the others)."""
        if token_ids is not None:
            self._prompt_token_ids[p] = token_ids

    def add_token_ids(self, p: int, chunk: wire.TokenChunk) -> None:
        """A streamed chunk's token ids (and the prompt's, on its first), sent with the choice's next chunk."""
        if not self.return_token_ids:
            return
        self.note_prompt_token_ids(p, chunk.prompt_token_ids)
        self._unsent_ids[p * self.n + chunk.index].extend(chunk.token_ids)

    def count(self, p: int, event: wire.TokenChunk | wire.GenerationResult) -> None:
        """Prompt `p`'s tokens so far, for the usage every chunk carries with `continuous_usage`:
        a chunk adds its output tokens; a result gives the prompt's exact counts."""
        if isinstance(event, wire.GenerationResult):
            self._prompt_tokens[p] = event.num_prompt_tokens
            self._output_tokens[p] = event.num_output_tokens
            return
        self.count_prompt(p, event.num_prompt_tokens)
        self._output_tokens[p] += len(event.token_ids)

    def count_prompt(self, p: int, num_prompt_tokens: int) -> None:
        """Prompt `p`'s tokens, as a chunk reports them (the first; 0 on the others)."""
        self._prompt_tokens[p] = max(self._prompt_tokens[p], num_prompt_tokens)

    def _usage_so_far(self) -> dict[str, int]:
        prompt_tokens, output_tokens = sum(self._prompt_tokens), sum(self._output_tokens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": output_tokens,
                "total_tokens": prompt_tokens + output_tokens}

    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        """A chat stream's first chunk of a choice (with `echo`, the message it continues)."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": self.echo_text},
                            "logprobs": None, "finish_reason": None}, has_ids=False)

    def thought_and_answer(self, text: str) -> tuple[str | None, str]:
        """A whole output's thoughts (None: none, or the model writes none apart) and its answer."""
        return split_reasoning(self.reasoning, text) if self.reasoning else (None, text)

    def delta(self, text: str, finish_reason: str | None,
              reported: list[wire.TokenLogprob] | None = None, index: int = 0) -> dict[str, Any] | None:
        """A stream's chunk of new text for choice `index` (None: nothing to send yet: tool calls
        asked for as `required` are sent whole, once they are; the start of what may be a
        reasoning model's tag). A reasoning model's thoughts go out as deltas of their own."""
        if not self._thinking:
            return self._answer_delta(text, finish_reason, reported, index)
        splitter = self._thinking[index]
        thought, text = splitter.feed(text) if finish_reason is None else splitter.last(text)
        chunk = self._answer_delta(text, finish_reason, reported, index) if text or finish_reason else None
        logprobs = reported if self.tools is None else None  # (a stream of tool calls carries none)
        if not thought:
            if chunk is None and logprobs and self.logprobs is not None:  # held back: its tokens' log-probabilities
                chunk = self._chunk({"index": index, "delta": {}, "logprobs": self._logprobs(logprobs, index=index),
                                     "finish_reason": None})
            return chunk
        if chunk is None:
            return self._thought_chunk(thought, index, logprobs)
        choice = chunk["choices"][0]
        choice["delta"] = {**thought_fields(thought), **choice["delta"]}
        return chunk

    def _thought_chunk(self, thought: str, index: int,
                       reported: list[wire.TokenLogprob] | None = None) -> dict[str, Any]:
        logprobs = self._logprobs(reported, index=index) if reported else None
        return self._chunk({"index": index, "delta": thought_fields(thought), "logprobs": logprobs,
                            "finish_reason": None})

    def _answer_delta(self, text: str, finish_reason: str | None, reported: list[wire.TokenLogprob] | None,
                      index: int) -> dict[str, Any] | None:
        logprobs = self._logprobs(reported, index=index) if reported else None
        if self.is_chat and self.tools is not None and finish_reason is None:
            return self._call_delta(text, index)
        if self.is_chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        return self._chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

    def echo(self, prompt: wire.EchoedPrompt, index: int = 0) -> dict[str, Any]:
        """A stream's first chunk of a choice when the prompt is echoed: the prompt and its log-probabilities."""
        return self._chunk({"index": index, "text": self._prompt_text(prompt, index),
                            "logprobs": self._logprobs([], prompt, index), "finish_reason": None}, has_ids=False)

    def _prompt_text(self, prompt: wire.EchoedPrompt, index: int) -> str:
        sent = self.prompt_texts[index // self.n]
        return sent if sent is not None else prompt.text

    def finish_chunks(self, p: int, payload: wire.GenerationResult) -> list[dict[str, Any]]:
        """A stream's last chunk of each of prompt `p`'s choices, with its finish reason (and
        before it, tool calls asked for as `required`, whole)."""
        chunks = []
        for j, choice in enumerate([wire.GeneratedChoice(payload.text, payload.finish_reason), *payload.choices]):
            index = p * self.n + j
            if self.tools is None:
                chunks.append(self.delta(choice.text, choice.finish_reason, index=index))
                continue
            last_text = choice.text
            if self._thinking:  # the thoughts' end, before the calls (which are read from the answer)
                thought, last_text = self._thinking[index].last(last_text)
                if thought:
                    chunks.append(self._thought_chunk(thought, index))
            if self.tools.named is not None:
                calls: list[dict[str, Any]] | None = [] if self._call_ids[index] is not None else None
            else:  # the whole text read as the unstreamed answer reads it: the content not sent yet, the calls
                content, calls = self._auto_rest(index, last_text)
                if content:
                    chunks.append(self._chunk({"index": index, "delta": {"content": content}, "logprobs": None,
                                               "finish_reason": None}))
                if calls:
                    chunks.append(self._chunk({"index": index, "delta": self._calls_delta(calls), "logprobs": None,
                                               "finish_reason": None}))
            reason = self._finish_reason(choice.finish_reason, calls)
            chunks.append(self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}))
        return [chunk for chunk in chunks if chunk is not None]

    def _calls_delta(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """A stream's delta of whole calls: `tool_calls`, or the legacy `function_call`."""
        if self.is_legacy_functions:
            return {"function_call": calls[0]["function"]}
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer as (content, tool calls): the calls asked for, content None (cut by
        max_tokens: those written whole, `ToolPlan.calls`); with `auto`, the calls found and the
        rest."""
        assert self.tools is not None
        if self.tools.parser:
            content, found = self.tools.split(text)
            return (content or None, found) if found else (content, None)
        return None, self.tools.calls(text)

    def _call_delta(self, text: str, index: int) -> dict[str, Any] | None:
        assert self.tools is not None
        if self.tools.parser:
            return self._auto_delta(text, index)
        if self.tools.named is None:
            self._calls_text[index] += text
            return None
        if self._call_ids[index] is None:  # the call's first chunk names it
            call = tool_call(self.tools.named, text)
            self._call_ids[index] = call["id"]
            delta = {"index": 0, **call}
        else:
            delta = {"index": 0, "function": {"arguments": text}}
        calls = {"function_call": delta["function"]} if self.is_legacy_functions else {"tool_calls": [delta]}
        return self._chunk({"index": index, "delta": calls, "logprobs": None, "finish_reason": None})

    def _auto_delta(self, text: str, index: int) -> dict[str, Any] | None:
        """`auto`: content streams until a call begins (text that may be its first characters is
        held back, and so is whitespace, which the answer drops if a call follows it); from there
        on everything waits for the end, to be read as calls and content."""
        self._texts[index] += text
        if self._calls_text[index]:
            self._calls_text[index] += text
            return None
        assert self.tools is not None
        text = self._held[index] + text
        safe, begun = self.tools.begin(text, at_start=not self._shown[index])
        safe = len(text[:safe].rstrip())
        shown, self._held[index] = text[:safe], ""
        if begun:
            self._calls_text[index] = text[safe:]
        else:
            self._held[index] = text[safe:]
        self._shown[index] = self._shown[index] or bool(shown)
        if not shown:
            return None
        self._sent[index] += shown
        return self._chunk({"index": index, "delta": {"content": shown}, "logprobs": None, "finish_reason": None})

    def _auto_rest(self, index: int, last_text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """At the end of a stream (`auto` or `required`): the content still to send and the calls,
        so that the content streamed is the unstreamed answer's exactly (what was sent is where it
        starts)."""
        rest = self._held[index] + self._calls_text[index] + last_text
        assert self.tools is not None
        if not self.tools.parser:  # `required`: nothing was sent
            return self.answer(rest)
        content, calls = self.answer(self._texts[index] + last_text)
        sent = self._sent[index]
        if (content or "").startswith(sent):
            return (content or "")[len(sent):], calls
        return self.answer(rest)  # not expected: the rest read alone

    def _finish_reason(self, reason: str, calls: list[dict[str, Any]] | None) -> str:
        """"tool_calls" (legacy: "function_call") for an answer that is whole tool calls; a cut one
        keeps its "length"."""
        if calls is None or reason != "stop":
            return reason
        return "function_call" if self.is_legacy_functions else "tool_calls"

    def usage_chunk(self, payloads: Sequence[wire.GenerationResult]) -> dict[str, Any]:
        name = "chat.completion.chunk" if self.is_chat else "text_completion"
        return {**self._head(name), "choices": [], "usage": usage(payloads, bool(self.reasoning))}

    def logprobs_of(self, reported: list[wire.TokenLogprob]) -> dict[str, Any] | None:
        """Tokens' log-probabilities in the endpoint's shape (None when they were not asked for)."""
        return self._logprobs(reported)

    def _logprobs(self, reported: list[wire.TokenLogprob], prompt: wire.EchoedPrompt | None = None,
                  index: int = 0) -> dict[str, Any] | None:
        """A choice's `logprobs` in the endpoint's own shape; None when they were not asked for.

        chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [k of the same]}]}
        completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob} of the k and
                      the chosen one], "text_offset"}; an echoed prompt's tokens come first, the
                      first of them with null for its log-probability and alternatives
        """
        if self.logprobs is None:
            return None
        if prompt is not None and not self.is_chat:
            return _joined(self._prompt_logprobs(prompt, index), self._logprobs(reported, index=index))
        if self.is_chat:
            return {"content": [{**_chat_logprob(lp.token, lp.logprob, lp.token_bytes),
                                 "top_logprobs": [_chat_logprob(top.token, top.logprob, top.token_bytes)
                                                  for top in lp.top]}
                                for lp in reported], "refusal": None}
        offsets = [self._offset(index, lp.token, lp.token_bytes) for lp in reported]
        return {"tokens": [lp.token for lp in reported], "token_logprobs": [lp.logprob for lp in reported],
                "top_logprobs": [{**{top.token: top.logprob for top in lp.top}, lp.token: lp.logprob}
                                 for lp in reported],
                "text_offset": offsets}

    def _offset(self, index: int, token: str, token_bytes: bytes | None) -> int:
        """Where a choice's next token starts in its text (`text_offset`): the characters before
        it. The tokens of a character split over several (each U+FFFD alone) all start at it."""
        offset = self._text_offsets[index]
        self._text_offsets[index] += len(self._decoders[index].decode(token.encode() if token_bytes is None
                                                                      else token_bytes))
        return offset

    def _prompt_logprobs(self, prompt: wire.EchoedPrompt, index: int) -> dict[str, Any]:
        first = {"tokens": [prompt.first_token], "token_logprobs": [None], "top_logprobs": [None],
                 "text_offset": [self._offset(index, prompt.first_token, prompt.first_token_bytes)]}
        rest = self._logprobs(prompt.logprobs or [], index=index)
        assert rest is not None
        return _joined(first, rest)


def _joined(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Two completions `logprobs` objects as one: each list of the first, then the second's."""
    return {key: values + (tail or {}).get(key, []) for key, values in head.items()}


def _chat_logprob(token: str, logprob: float, token_bytes: bytes | None) -> dict[str, Any]:
    """`bytes`: the token's own (joined across a character's tokens they give its UTF-8, as
    OpenAI documents), not its text's where that is U+FFFD for part of a character."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode() if token_bytes is None else token_bytes)}


def usage(payloads: Sequence[wire.GenerationResult], reasoning: bool = False) -> dict[str, Any]:
    """The request's token counts: every prompt's, and every choice's output (of a reasoning
    model's chat, those it thought with too)."""
    num_prompt_tokens = sum(p.num_prompt_tokens for p in payloads)
    num_output_tokens = sum(p.num_output_tokens for p in payloads)
    counts: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(p.num_cached_tokens for p in payloads)},
    }
    writes = [p.num_cache_write_tokens for p in payloads]
    if None not in writes:  # known (an upstream server may not say)
        counts["prompt_tokens_details"]["cache_write_tokens"] = sum(w for w in writes if w is not None)
    if reasoning:
        counts["completion_tokens_details"] = {"reasoning_tokens": sum(p.num_reasoning_tokens for p in payloads)}
    return counts
