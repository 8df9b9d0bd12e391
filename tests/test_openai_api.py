"""The `openai` frontend, exercised with the official `openai` client (and raw HTTP for what
a client library would never send) against a real `tokenloom serve` process on loopback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from tokenloom.protocols.websocket.client import Client  # noqa: E402
from tokenloom.protocols.websocket.messages import Done  # noqa: E402

CLI = [sys.executable, "-m", "tokenloom.cli.main"]
KEY = "test-key-123"
ORIGIN = "http://allowed.example"
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tokenloom serve` with both frontends, an API key, one allowed Origin and a queue of 2,
    over a tiny model 48 layers deep, so a 900-token request is still running when a test
    hangs up on it or fills the queue with it (16 layers were ~2 ms a token op by op; the
    captured decode step made them fast enough that the hang-up test flaked under load)."""
    from conftest import make_tiny_llama

    model_dir = tmp_path_factory.mktemp("deep-tiny")
    make_tiny_llama(model_dir, num_layers=48)
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY)
    proc = subprocess.Popen([*CLI, "serve", "--model", str(model_dir), "--dtype", "float32",
                             "--num-kv-blocks", "128", "--port", "0", "--openai-port", "0", "--max-queue", "2",
                             "--api-key-file", str(key_file), "--allow-origin", ORIGIN, "--shutdown-deadline", "0.2",
                             "--set", "frontends.openai.served_model_name=\"tiny\""],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TOKENLOOM_LOG_FORMAT": "json"})
    urls = {}
    for line in proc.stderr:
        if m := re.search(r"(ws://127\.0\.0\.1:\d+)", line):
            urls["ws"] = m.group(1)
        if m := re.search(r"(http://127\.0\.0\.1:\d+/v1)", line):
            urls["openai"] = m.group(1)
            break
    assert set(urls) == {"ws", "openai"}, "server did not start"
    yield proc, urls["openai"], urls["ws"]
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1], api_key=KEY, max_retries=0)


def _model(client) -> str:
    return client.models.list().data[0].id


def _http(url: str, body: bytes | None = None, *, method: str | None = None, headers: dict | None = None,
          key: str | None = KEY):
    """(status, headers, parsed JSON or text) of one raw HTTP request."""
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    req = urllib.request.Request(url, data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, hdrs, data = r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, data = e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()
    try:
        return status, hdrs, json.loads(data)
    except ValueError:
        return status, hdrs, data.decode()


def _ws_stats(ws_url: str) -> dict:
    return _http(ws_url.replace("ws://", "http://") + "/stats")[2]


def _wait_engine_idle(ws_url: str, timeout: float = 10.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        s = _ws_stats(ws_url)["stats"]
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0:
            return s
        assert time.monotonic() < end, f"engine still busy: {s}"
        time.sleep(0.02)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "tiny"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


async def test_chat_whole_and_streamed_agree_with_the_websocket_api(client, served):
    model = _model(client)
    whole = client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=12)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and whole.usage.completion_tokens >= 1
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content and finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: prefix cache
    assert all(c.usage is None for c in chunks[:-1])

    async with Client(served[2], api_key=KEY) as ws:  # the other frontend, the same engine
        events = [ev async for ev in ws.generate(messages=HI, params={"temperature": 0, "max_tokens": 12})]
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == choice.finish_reason
    assert "".join(e.text for e in events[:-1] if hasattr(e, "text")) == choice.message.content


def test_completions_whole_streamed_and_logprobs(client):
    model = _model(client)
    whole = client.completions.create(model=model, prompt="Once upon", temperature=0, max_tokens=8, logprobs=2)
    c = whole.choices[0]
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 8
    assert len(c.logprobs.tokens) == 8 and len(c.logprobs.token_logprobs) == 8
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    offsets = c.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(c.text)
    # 20 alternatives spelled 20 ways: a byte that is part of a character is `bytes:\xNN`,
    # so tokens that would all print as U+FFFD do not collide in the legacy dict
    wide = client.completions.create(model=model, prompt="Once upon", temperature=0, max_tokens=4, logprobs=20)
    assert all(len(top) == 20 for top in wide.choices[0].logprobs.top_logprobs)
    assert any(k.startswith("bytes:\\x") for top in wide.choices[0].logprobs.top_logprobs for k in top)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="Once upon", temperature=0, max_tokens=8, stream=True) if ch.choices)
    assert streamed == c.text
    ids = client.completions.create(model=model, prompt=[104, 105], temperature=0, max_tokens=3)
    assert ids.usage.prompt_tokens == 2

    chat = client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=4, logprobs=True,
                                          top_logprobs=3, seed=7, stop=["\n\n"])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    for t in content:  # `bytes` are the token's own bytes; `token` is their text where they are whole
        raw = bytes(t.bytes)
        assert t.token == (raw.decode() if not t.token.startswith("bytes:") else "bytes:" + "".join(
            f"\\x{b:02x}" for b in raw))
    # greedy: the chosen token is the most likely one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    penalised = client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=4,
                                               presence_penalty=0.5, frequency_penalty=0.5)
    assert penalised.usage.completion_tokens == 4
    targeted = client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=4,
                                              extra_body={"slo_class": "interactive", "ttft_ms": 5000, "tpot_ms": 500})
    assert targeted.usage.completion_tokens == 4


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 500}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"frequency_penalty": 9}, "frequency_penalty"),
    ({"seed": -1}, "seed"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"extra_body": {"decoder": "nonesuch"}}, "decoder"),
    ({"extra_body": {"slo_class": "not a class!"}}, "slo_class"),
    ({"extra_body": {"ttft_ms": -5}}, "ttft_ms"),
    ({"max_tokens": 5000}, "max_tokens"),  # past the context length
])
def test_an_invalid_parameter_is_a_bad_request_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=_model(client), messages=HI, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert info.value.body["type"] == "invalid_request_error"


def test_a_bad_key_is_an_authentication_error(served):
    bad = openai.OpenAI(base_url=served[1], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=HI)
    assert _http(served[1].removesuffix("/v1") + "/health", key=None)[0] == 200  # health needs no key


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"


def test_a_client_that_leaves_mid_stream_frees_its_blocks(client, served):
    ws = served[2]
    model = _model(client)
    before = _ws_stats(ws)["stats"]
    with client.chat.completions.create(model=model, messages=HI, max_tokens=900, stream=True,
                                        extra_body={"ignore_eos": True}) as stream:
        got = [next(stream) for _ in range(5)]
        assert any(c.choices[0].delta.content for c in got[1:])
        assert _ws_stats(ws)["stats"]["kv_blocks_used"] > 0  # it holds blocks while it streams
    t0 = time.monotonic()
    after = _wait_engine_idle(ws)
    assert time.monotonic() - t0 < 2.0
    assert after["generated_tokens"] - before["generated_tokens"] < 900  # it stopped early
    end = time.monotonic() + 5  # its end is counted once the engine has ended it (a moment later)
    while _num_aborted(ws) == 0:
        assert time.monotonic() < end, "the aborted request was never counted"
        time.sleep(0.02)


def _num_aborted(ws_url: str) -> int:
    metrics = _http(ws_url.replace("ws://", "http://") + "/metrics")[2]
    m = re.search(r'tokenloom_requests_total\{finish_reason="aborted"\} ([0-9.]+)', metrics)
    return int(float(m.group(1))) if m else 0


def test_a_client_that_leaves_a_whole_answer_frees_its_blocks(client, served):
    import http.client

    aborted = _num_aborted(served[2])
    port = int(served[1].rsplit(":", 1)[1].split("/")[0])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 900, "ignore_eos": True})
    conn.request("POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}",
                                                        "Content-Type": "application/json"})
    end = time.monotonic() + 5
    while _ws_stats(served[2])["stats"]["running"] == 0:
        assert time.monotonic() < end
        time.sleep(0.01)
    conn.sock.close()  # hang up before the answer
    after = _wait_engine_idle(served[2])
    assert after["kv_blocks_used"] == 0
    assert _num_aborted(served[2]) == aborted + 1  # ended by the hang-up, not by max_tokens


def test_a_full_queue_is_503_with_retry_after_and_serving_goes_on(client, served):
    model = _model(client)
    streams = [client.chat.completions.create(model=model, messages=HI, max_tokens=900, stream=True,
                                              extra_body={"ignore_eos": True}) for _ in range(2)]
    for s in streams:
        next(s)
    status, headers, body = _http(served[1] + "/chat/completions",
                                  json.dumps({"model": model, "messages": HI}).encode())
    assert status == 503 and body["error"]["code"] == "overloaded" and int(headers["retry-after"]) >= 1
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=model, messages=HI, max_tokens=2)
    for s in streams:
        s.close()
    _wait_engine_idle(served[2])
    assert client.chat.completions.create(model=model, messages=HI, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("body, status, param", [
    (b'{"model": "tiny", "messages": [', 400, None),  # malformed JSON
    (b'[1, 2]', 400, None),  # not an object
    (b'{"model": "tiny"}', 400, "messages"),  # missing field
    (b'{"model": "tiny", "messages": "hi"}', 400, "messages"),  # wrong type
    (b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    (b'{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}', 400, "messages"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "messages"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', 400, "max_tokens"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": [1]}', 400, "stop"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}', 400, "tools"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 1e300}', 400, "seed"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (1 << 20) + b'"}]}', 413, None),
])
def test_bad_http_requests_are_4xx_in_openai_shape_and_serving_goes_on(client, served, body, status, param):
    got, _, data = _http(served[1] + "/chat/completions", body)
    assert got == status, data
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["param"] == param
    assert client.chat.completions.create(model="tiny", messages=HI, max_tokens=1).usage.completion_tokens == 1


@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny", "prompt": ["a", "b"]}', "prompt"),
    (b'{"model": "tiny", "prompt": [1, -2]}', "prompt"),
    (b'{"model": "tiny", "prompt": "x", "echo": "yes"}', "echo"),
    (b'{"model": "tiny", "prompt": "x", "n": 3, "best_of": 2}', "best_of"),
    (b'{"model": "tiny", "prompt": "x", "suffix": "y"}', "suffix"),
    (b'{"model": "tiny", "prompt": "x", "logprobs": 99}', "logprobs"),
])
def test_bad_completions_requests_name_the_field(served, body, param):
    got, _, data = _http(served[1] + "/completions", body)
    assert got == 400 and data["error"]["param"] == param, data


def test_routes_methods_and_origins(served):
    base = served[1].removesuffix("/v1")
    status, _, data = _http(base + "/v1/nothing")
    assert status == 404 and data["error"]["code"] == "not_found"
    status, _, data = _http(base + "/v1/models", method="DELETE")
    assert status == 405 and "error" in data
    status, _, data = _http(base + "/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 403 and data["error"]["code"] == "origin_not_allowed"
    status, headers, _ = _http(base + "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = _http(base + "/v1/chat/completions", method="OPTIONS", key=None,
                               headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert status == 204 and "authorization" in headers["access-control-allow-headers"].lower()
    asked = "authorization, content-type, x-stainless-lang"  # what OpenAI's JS client asks for
    status, headers, _ = _http(base + "/v1/chat/completions", method="OPTIONS", key=None,
                               headers={"Origin": ORIGIN, "Access-Control-Request-Headers": asked})
    assert status == 204 and headers["access-control-allow-headers"] == asked


def test_the_example_client_runs_unchanged(served):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "clients", "openai_client.py")
    res = subprocess.run([sys.executable, example, "hello", "--base-url", served[1], "--max-tokens", "6"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "TOKENLOOM_API_KEY": KEY})
    assert res.returncode == 0, res.stderr
    assert "model: tiny" in res.stdout and "(6 tokens, finish length)" in res.stdout
    assert "prompt tokens from the prefix cache]" in res.stdout


@pytest.mark.slow
def test_the_embedded_model_answers_through_the_openai_api():
    """`tokenloom serve` on the embedded model, default name, fp32 dequantised weights: the
    official client gets the reference answer, whole and streamed."""
    proc = subprocess.Popen([*CLI, "serve", "--dtype", "float32", "--quantizer", "none", "--kv-cache-memory-mb", "128",
                             "--openai-port", "0", "--frontends", "openai"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TOKENLOOM_LOG_FORMAT": "json"})
    try:
        base = None
        for line in proc.stderr:
            if m := re.search(r"(http://127\.0\.0\.1:\d+/v1)", line):
                base = m.group(1)
                break
        assert base and "ws://" not in line
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        assert client.models.list().data[0].id == "smollm2-135m"
        question = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model="smollm2-135m", messages=question, temperature=0)
        assert whole.choices[0].message.content == "The capital of France is Paris."
        assert whole.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2-135m", messages=question, temperature=0, stream=True))
        assert streamed == "The capital of France is Paris."
    finally:
        proc.terminate()
        proc.wait(timeout=30)
