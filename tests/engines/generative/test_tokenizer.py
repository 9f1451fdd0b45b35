"""Tokenizer side: tiny-lm generation, incremental detokenization, stop strings, chat templates."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sluice.engines.generative import EngineConfig, LLMEngine, SamplingParams
from sluice.engines.generative.tiny import make_tiny_lm
from sluice.engines.generative.tokenizer import Detokenizer, StopChecker, Tokenizer
from tests.engines.generative.conftest import run_to_completion


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lm(tmp_path_factory.mktemp("tiny") / "tiny-lm")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tiny_lm_is_byte_identical_across_runs(tiny_dir, tmp_path):
    assert _digests(make_tiny_lm(tmp_path / "again")) == _digests(tiny_dir)
    assert set(_digests(tiny_dir)) == {"config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"}


def test_incremental_detokenization_handles_multibyte_and_spaces(tiny_dir):
    tok = Tokenizer(tiny_dir)
    text = "Über café 東京 数据 🙂 the model, naïve!"
    ids = tok.encode(text)
    detok = Detokenizer(tok, tok.encode("Prompt:"))
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_held_back_then_stripped():
    checker = StopChecker(["STOP"])
    emitted = []
    for ch in "say ST":
        emitted.append(checker.push(ch)[0])
    assert "".join(emitted) == "say "  # "ST" could begin the stop string
    out, hit = checker.push("OP and more")
    assert hit and "".join(emitted) + out == "say "
    no_stop = StopChecker(["xyz"])
    assert no_stop.push("ab")[0] + no_stop.push("x")[0] + no_stop.flush() == "abx"


def test_the_stop_string_can_end_the_text_instead():
    checker = StopChecker(["ST", "STOP", "zz"], include_stop=True)
    out, hit = checker.push("say STOP and more")
    assert hit and out == "say STOP"  # of the strings that start first, the longest


class _CountedStop(str):
    """A stop string that counts the prefix checks made against it."""

    checks = 0

    def startswith(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _CountedStop.checks += 1
        return super().startswith(*args, **kwargs)


def test_holding_back_is_linear_in_the_output_however_long_the_stop_strings():
    """Each offset of the text is ruled out as a stop string's start once, not at every token:
    64 stop strings of 20,000 characters over 2,000 one-character pushes cost about one check per
    push per string (it was one per character of text per push per string: quadratic, seconds of
    the device thread's time in a 1,000-token answer)."""
    stops = [_CountedStop(f"{i % 10}" + "q" * 20_000) for i in range(64)]
    checker = StopChecker(stops)
    _CountedStop.checks = 0
    text = "".join("0123456789 qz"[(i * 7) % 13] for i in range(2_000))
    out = "".join(checker.push(ch)[0] for ch in text) + checker.flush()
    assert out == text
    assert _CountedStop.checks < 4 * len(text) * len(stops)
    held = StopChecker([_CountedStop("abcd")])  # still held back while it could become the stop string
    assert held.push("xxab")[0] == "xx" and held.push("c")[0] == "" and held.push("e")[0] == "abce"


def test_text_before_min_tokens_never_starts_a_stop_string():
    checker = StopChecker(["ab"])
    assert checker.push("xab", can_stop=False) == ("xab", False)
    assert checker.push("a", can_stop=False) == ("a", False)
    assert checker.push("b") == ("b", False)  # "ab" straddles the protected text: no stop
    assert checker.push("zzab") == ("zz", True)


def test_chat_template_from_tokenizer_config(tiny_dir):
    tok = Tokenizer(tiny_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    assert tok.eos_token_ids == (0,)


def test_default_chat_template_shows_tools_and_earlier_calls(tiny_dir, tmp_path):
    """A model folder without a chat template gets the default one: plain messages as before, the
    tools as JSON first, and an assistant's calls as JSON after its content."""
    folder = tmp_path / "no-template"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "content": "42", "tool_call_id": "c1"}],
        tools=[{"type": "function", "function": {"name": "f", "description": "d"}}])
    assert rendered == ('<|tools|>\n[{"function": {"description": "d", "name": "f"}, "type": "function"}]\n'
                        '<|user|>\nhi\n<|assistant|>\n[{"function": {"arguments": {"x": 1}, "name": "f"}, '
                        '"id": "c1", "type": "function"}]\n<|tool|>\n42\n<|assistant|>\n')


def test_engine_stops_on_a_stop_string_and_strips_it(tiny_dir):
    engine = LLMEngine(tiny_dir, EngineConfig(block_size=8, num_kv_blocks=64))
    prompt = engine.tokenizer.encode("the model serve the request")
    engine.add_request("ref", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    texts: dict[str, str] = {}

    def drain() -> None:
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta

    drain()
    full = texts["ref"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    engine.add_request("s", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,)))
    drain()
    assert texts["s"] == full[:full.index(stop)]
    assert run_to_completion(engine) == {}


def test_stop_strings_wait_for_min_tokens(tiny_dir):
    engine = LLMEngine(tiny_dir, EngineConfig(block_size=8, num_kv_blocks=64))
    prompt = engine.tokenizer.encode("the model serve the request")
    engine.add_request("ref", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    reference = run_to_completion(engine)["ref"]
    first_text = engine.tokenizer.decode(reference[:1]).strip()
    assert first_text
    params = SamplingParams(max_tokens=24, min_tokens=6, temperature=0, ignore_eos=True, stop=(first_text,))
    engine.add_request("s", prompt, params)
    out = run_to_completion(engine)["s"]
    # the reference repeats its first token's text every few tokens: the first repeat after the
    # sixth token ends the output there, with the stop string in it
    assert out == reference[:7]


def test_chat_template_kwargs_reach_the_template_and_a_final_message_can_be_continued(tmp_path):
    import json

    from sluice.engines.generative.tiny import make_tiny_lm

    model = make_tiny_lm(tmp_path / "m")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if enable_thinking %}<think>{% endif %}" + config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(model)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}]
    assert tokenizer.apply_chat_template(messages, enable_thinking=True).startswith("<think><|user|>")
    assert not tokenizer.apply_chat_template(messages).startswith("<think>")
    assert tokenizer.apply_chat_template(messages, False, continue_final_message=True).endswith("<|assistant|>\nOnce")
    with pytest.raises(ValueError, match="continue_final_message"):
        tokenizer.apply_chat_template([*messages[:1], {"role": "assistant", "content": ""}], False,
                                      continue_final_message=True)


def test_a_tokens_bytes_are_its_own_where_its_text_alone_is_part_of_a_character(tiny_dir, tmp_path):
    """Byte-level BPE (GPT-2's alphabet, tiny-lm's) and SentencePiece-style byte fallback
    (`<0xE4>` pieces, Llama 2's): joined, the bytes are the text's UTF-8."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    text = "中文 😀 ok"  # not in tiny-lm's training text: its bytes are tokens of their own
    tok = Tokenizer(tiny_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.token_text(i) for i in ids)
    assert b"".join(tok.token_bytes(i) or tok.token_text(i).encode() for i in ids) == text.encode()
    assert tok.token_bytes(tok.encode("ok", add_special_tokens=False)[0]) is None  # whole characters: its text

    vocab = {"<unk>": 0, "▁ok": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    fallback = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    fallback.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    pieces = [2 + b for b in "数".encode()]
    assert all(tok.token_text(i) == "\ufffd" for i in pieces)
    assert b"".join(tok.token_bytes(i) or b"" for i in pieces) == "数".encode()
    assert tok.token_bytes(1) is None
