"""The README's Quickstart runs as it shows: its curl requests, `openai` SDK snippets and
`tritonclient` snippets, taken from the README's own text and run in order against one real
demo server, answer what the README shows (the KServe answer it prints, the 384-dimension
embeddings, the outputs in its comments). Edit the Quickstart so that it no longer works and
this fails."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.repository import demo_repository
from tests.conftest import ServerProcess, eventually, start_server

pytestmark = pytest.mark.slow
README = Path(__file__).parents[2] / "README.md"
HTTP_ADDRESS, GRPC_ADDRESS = "127.0.0.1:8000", "127.0.0.1:8001"  # where the README's examples connect


def quickstart() -> str:
    """The README up to its section after the Quickstart (its first ~160 lines)."""
    text = README.read_text()
    return text[: text.index("\n## ", text.index("## Quickstart"))]


def first(pattern: str, text: str) -> str:
    """The first group of `pattern`'s first match in `text`."""
    found = re.search(pattern, text)
    assert found is not None, f"no {pattern!r} in {text!r}"
    return found[1]


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", quickstart(), re.S | re.M)


def curl_commands() -> list[tuple[str, str]]:
    """Each curl command of the Quickstart's bash blocks (continuation lines joined), with the
    comment lines that follow it (the answer it shows, if any)."""
    commands: list[tuple[str, str]] = []
    for block in code_blocks("bash"):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if line.lstrip().startswith("curl "):
                commands.append((line.strip(), ""))
            elif line.startswith("#") and commands:
                commands[-1] = (commands[-1][0], (commands[-1][1] + "\n" + line[1:].strip()).strip())
    return commands


def send(command: str, base_url: str) -> httpx.Response:
    """`curl URL [-H 'Name: value'] -d 'BODY'` sent as curl sends it (`-d`: a POST of the body as given)."""
    words = shlex.split(command)
    assert words[0] == "curl", command
    url, headers, body = None, {}, None
    rest = iter(words[1:])
    for word in rest:
        if word == "-H":
            name, value = next(rest).split(":", 1)
            headers[name.strip()] = value.strip()
        elif word == "-d":
            body = next(rest)
        else:
            assert url is None and not word.startswith("-"), f"an option this test does not know: {word} in {command}"
            url = word
    assert url is not None and url.startswith("localhost:8000/"), command
    full_url = base_url + url.removeprefix("localhost:8000")
    if body is None:
        return httpx.get(full_url, headers=headers, timeout=60)
    headers.setdefault("Content-Type", "application/x-www-form-urlencoded")  # curl's default for -d
    return httpx.post(full_url, content=body.encode(), headers=headers, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    """The demo repository served as the Quickstart says (`sluice serve`, with `--grpc-port` for
    its gRPC example), on free ports: the HTTP one and the gRPC one the banner names."""
    log_dir = tmp_path_factory.mktemp("readme")
    started = start_server(demo_repository(), log_dir, "--grpc-port", "0")
    try:
        pattern = re.compile(r"KServe v2 over gRPC on 127\.0\.0\.1:(\d+)")
        eventually(lambda: pattern.search(started.log()) is not None, "the banner's gRPC address")
        found = pattern.search(started.log())
        assert found is not None
        yield started, int(found[1])
    finally:
        started.stop()


def test_the_quickstart_curl_requests_answer_as_shown(server):
    http_server, _ = server
    commands = curl_commands()
    paths = [first(r"localhost:8000(\S+)", command) for command, _ in commands]
    assert paths == ["/v1/embeddings", "/v2/models/emulated/infer", "/v2/models/tiny-lm/generate_stream"]
    answers = [send(command, http_server.url) for command, _ in commands]
    for (command, _), answer in zip(commands, answers, strict=True):
        assert answer.status_code == 200, f"{command}\n{answer.text}"

    (embed_command, _), (_, shown), _ = commands
    sent = json.loads(first(r"-d '(.*?)'", embed_command))
    embeddings = answers[0].json()
    dims = int(first(r"\((\d+) dims\)", quickstart()))  # "minilm ... (384 dims)"
    assert dims == 384
    assert embeddings["object"] == "list" and embeddings["model"] == "minilm"
    assert [item["index"] for item in embeddings["data"]] == list(range(len(sent["input"])))
    assert all(len(item["embedding"]) == dims for item in embeddings["data"])
    assert embeddings["usage"]["prompt_tokens"] > 0

    assert shown.startswith("{"), "the README shows the KServe answer under its curl request"
    assert answers[1].json() == json.loads(shown)  # {"model_name":"emulated",...,"data":[10.0,26.0]}
    assert answers[1].text == shown  # to the byte, as the README prints it

    stream = answers[2]  # Triton's generate_stream: SSE of the new text, no [DONE]
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line.removeprefix("data: ")) for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events and "[DONE]" not in stream.text
    assert all(event["model_name"] == "tiny-lm" and isinstance(event["text_output"], str) for event in events)
    assert len(events) <= 16  # "max_tokens": 16: a chunk of new text at a time


def _shown(block: str) -> dict[str, str]:
    """Each `print(...)` line of a snippet with the output its comment shows."""
    return {line.split("#")[0].strip(): line.split("#", 1)[1].strip()
            for line in block.splitlines() if line.startswith("print(") and "#" in line}


def test_the_quickstart_python_snippets_run_in_order_and_print_what_they_show(server):
    http_server, grpc_port = server
    blocks = code_blocks("python")
    assert all(HTTP_ADDRESS in block or GRPC_ADDRESS in block or "127.0.0.1" not in block for block in blocks)
    namespace: dict[str, Any] = {"__name__": "readme"}  # as a script of its own: no __future__ of this module
    printed: list[list[str]] = []
    after: list[dict[str, Any]] = []  # the names each block left, as it left them
    for number, block in enumerate(blocks):
        code = block.replace(HTTP_ADDRESS, f"127.0.0.1:{http_server.port}").replace(GRPC_ADDRESS,
                                                                                    f"127.0.0.1:{grpc_port}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                exec(compile(code, f"README.md python block {number + 1}", "exec", dont_inherit=True), namespace)
            except Exception as error:
                pytest.fail(f"the README's python block {number + 1} fails with {error!r}:\n{block}")
        printed.append(out.getvalue().splitlines())
        after.append(dict(namespace))

    def block_with(text: str) -> tuple[str, list[str], dict[str, Any]]:
        found = [run for run in zip(blocks, printed, after, strict=True) if text in run[0]]
        assert len(found) == 1, f"one Quickstart python block with {text!r}"
        return found[0]

    # The openai SDK: embeddings, "# 384 ..."
    block, lines, _ = block_with("client.embeddings.create(")
    assert _shown(block)["print(len(result.data[0].embedding), result.usage.prompt_tokens)"] == "384 ..."
    dims, prompt_tokens = lines[0].split()
    assert dims == "384" and int(prompt_tokens) > 0

    # A streamed chat: text deltas, then (include_usage) the usage of at most max_tokens=16 tokens
    _, lines, names = block_with("stream=True")
    assert lines[-1].startswith("CompletionUsage(")
    usage = names["chunk"].usage
    assert 0 < usage.completion_tokens <= 16 and usage.prompt_tokens > 0

    # Responses, stored and continued, and a conversation: "# user, user, assistant"
    block, lines, names = block_with("client.responses.create(")
    response = names["response"]
    assert lines[0].split()[0] == response.status in ("completed", "incomplete")  # "cut at 16": incomplete
    assert response.usage.output_tokens <= 16
    assert names["follow_up"].status in ("completed", "incomplete")
    assert names["answer"].conversation.id == names["conversation"].id
    roles = [role.strip() for role in _shown(block)[
        '''print([item.role for item in client.conversations.items.list(conversation.id, order="asc")])'''].split(",")]
    assert lines[-1] == repr(roles) == "['user', 'user', 'assistant']"

    # Structured outputs: even random weights answer JSON that fits the schema
    block, lines, names = block_with("response_format=Pet")
    assert _shown(block)["print(reply.choices[0].message.parsed)"].startswith("e.g. kind='cat' age=")
    parsed = names["reply"].choices[0].message.parsed
    assert isinstance(parsed, names["Pet"]) and parsed.kind in ("cat", "dog") and 0 <= parsed.age <= 30
    assert re.fullmatch(r"kind='(cat|dog)' age=\d+", lines[0])

    # tritonclient over HTTP, binary tensors: "# [120. 376.]", then the embedding's "# (1, 384)"
    block, lines, _ = block_with("import tritonclient.http as httpclient")
    assert lines == list(_shown(block).values()) == ["[120. 376.]", "(1, 384)"]

    # and over gRPC
    block, lines, _ = block_with("import tritonclient.grpc as grpcclient")
    assert lines == list(_shown(block).values()) == ["[120. 376.]"]

    # A generative model over KServe infer: the prompt and its continuation
    _, lines, _ = block_with('InferInput("text_input"')
    assert lines[0].startswith("Once upon a time") and len(lines[0]) > len("Once upon a time")
