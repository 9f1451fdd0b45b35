"""What a request reserves against its tenant's tokens-per-minute limit before the model's
tokenizer has seen it: a bound on its tokens, so that concurrent requests cannot overshoot."""

from __future__ import annotations

from sluice import wire
from sluice.api.completion_params import estimate_tokens
from sluice.gateway.admission import estimate_text_tokens


def test_a_text_reserves_a_token_per_byte_which_no_tokenizer_exceeds():
    # tiny-lm's byte-level BPE makes 600 tokens of 200 emoji (800 bytes); a token per three
    # characters reserved 68
    assert estimate_text_tokens(["\N{GRINNING FACE}" * 200]) == 800 + 4
    assert estimate_text_tokens(["1,2,3,4,5,6,7,8,9,10"]) == 20 + 4  # 19 tokens on tiny-lm
    assert estimate_text_tokens(["\u4f60\u597d"]) == 6 + 4


def test_an_embedding_input_reserves_no_more_than_the_model_keeps_of_it():
    assert estimate_text_tokens(["word " * 1000, "hi"], max_tokens_per_text=256) == 256 + 2 + 4


def test_a_chat_reserves_its_template_and_a_generation_no_more_than_its_context():
    chat = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey 1")], max_tokens=30)
    # tiny-lm's template makes 10 tokens of this turn; 4 + 4 for the texts, 8 + 32 for the template
    assert estimate_tokens(chat) == (4 + 4) + (5 + 4) + 8 + 32 + 30
    long = wire.GeneratePayload(prompt="x" * 5000, max_tokens=500, n=2)
    assert estimate_tokens(long) == 5004 + 1000
    assert estimate_tokens(long, max_model_len=1024) == 2 * 1024
