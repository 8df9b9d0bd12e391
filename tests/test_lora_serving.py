"""LoRA adapters through the frontends: a real `tokenloom serve` process (its engine core in
a process of its own, the default) with ``--lora``, driven with the official `openai`
client (``model`` selects an adapter), raw HTTP (vLLM's load/unload routes) and the
WebSocket protocol (``params.adapter``); and the same OpenAI frontend over an in-process
engine. Every adapter's greedy tokens are checked against the in-process
``LLM(...).generate(..., SamplingParams(adapter=...))``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from tokenloom.core.sampling_params import SamplingParams  # noqa: E402
from tokenloom.protocols.openai.schema import token_text  # noqa: E402
from tokenloom.protocols.websocket.client import Client, RequestError  # noqa: E402
from tokenloom.protocols.websocket.messages import Delta, Done  # noqa: E402

from conftest import engine_core_pid, make_tiny_llama, start_serve_process, tiny_engine_kwargs  # noqa: E402

KEY = "lora-key-123"
PROMPT = "hello there"
MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _make_adapter(model_dir, out, targets, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # B is zero at init: make the update non-trivial
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model 16 layers deep (a 1000-token stream under an adapter then runs for a
    second or more: still running when a test unloads its adapter), two PEFT adapters
    (attention q/v; o and down) and a directory that is no adapter."""
    model_dir = tmp_path_factory.mktemp("lora-model")
    make_tiny_llama(model_dir, num_layers=16)
    root = tmp_path_factory.mktemp("adapters")
    bad = root / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return {"model": model_dir, "a0": _make_adapter(model_dir, root / "a0", ["q_proj", "v_proj"], 1),
            "a1": _make_adapter(model_dir, root / "a1", ["o_proj", "down_proj"], 2), "bad": str(bad)}


@pytest.fixture(scope="module")
def expected(files):
    """The in-process engine's greedy tokens for PROMPT: name (None: the base) -> (ids, text,
    the tokens as OpenAI's logprobs spell them)."""
    from tokenloom import LLM

    llm = LLM(**tiny_engine_kwargs(files["model"]), adapter={"name": "lora", "modules": {"a0": files["a0"],
                                                                                        "a1": files["a1"]}})
    try:
        out = {}
        for name in (None, "a0", "a1"):
            f = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, adapter=name, **GREEDY))[0]
            out[name] = (f.token_ids, f.text, [token_text(llm.tokenizer, t)[0] for t in f.token_ids])
    finally:
        llm.close()
    assert len({tuple(v[0]) for v in out.values()}) == 3, "the adapters must change the greedy tokens"
    return out


@pytest.fixture(scope="module")
def served(files, tmp_path_factory):
    """`tokenloom serve --lora a0=...` (the core in its own process), with an API key:
    (process, OpenAI base URL, WebSocket URL)."""
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY)
    proc, ws = start_serve_process("--model", str(files["model"]), "--dtype", "float32", "--port", "0",
                                   "--openai-port", "0", "--num-kv-blocks", "128", "--api-key-file", str(key_file),
                                   "--lora", f"a0={files['a0']}", "--shutdown-deadline", "0.2",
                                   "--set", "frontends.openai.served_model_name=\"tiny\"")
    base = None
    for line in proc.stderr:
        if m := re.search(r"(http://127\.0\.0\.1:\d+/v1)", line):
            base = m.group(1)
            break
    if base is None:
        proc.kill()
        raise AssertionError("no OpenAI URL in the banner")
    # keep reading its log, into a file, so that a full pipe never stalls the server
    log_path = tmp_path_factory.mktemp("serve-log") / "stderr.log"

    def keep_log():
        with open(log_path, "w") as f:
            for line in proc.stderr:
                f.write(line)
                f.flush()

    threading.Thread(target=keep_log, daemon=True).start()
    yield proc, base, ws
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1], api_key=KEY, max_retries=0, timeout=120)


def _http(url: str, body: dict | bytes | None = None, *, key: str | None = KEY, method: str | None = None):
    """(status, parsed JSON or text) of one raw request."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def _complete(client, model, **kw):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True}, **kw)


def _assert_tokens(completion, want):
    ids, text, tokens = want
    choice = completion.choices[0]
    assert choice.logprobs.tokens == tokens and choice.text == text and choice.finish_reason == "length"


# ---- the serve process, its core apart ----------------------------------------------------
def test_model_selects_the_adapter_with_the_in_process_tokens(client, expected):
    for model, name in (("tiny", None), ("a0", "a0")):
        got = _complete(client, model)
        _assert_tokens(got, expected[name])
        assert got.model == model  # an adapter's answer names it, as vLLM's do
    chat = client.chat.completions.create(model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "a0" and chat.choices[0].message.content is not None


def test_models_lists_each_adapter_with_its_parent(client, served, files):
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert list(cards) == ["tiny", "a0"]
    assert cards["a0"]["root"] == files["a0"] and cards["a0"]["parent"] == "tiny"
    assert cards["tiny"]["parent"] is None and cards["a0"]["max_model_len"] == cards["tiny"]["max_model_len"]
    assert client.models.retrieve("a0").model_dump()["parent"] == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("a9")


def test_an_unknown_model_is_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "a9")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert "'a9'" in info.value.body["message"]


def test_load_at_run_time_then_use_it(client, served, files, expected):
    base = served[1]
    status, body = _http(base + "/load_lora_adapter", {"lora_name": "a1", "lora_path": files["a1"]})
    assert (status, body) == (200, "Success: LoRA adapter 'a1' added successfully.")
    assert [m.id for m in client.models.list().data] == ["tiny", "a0", "a1"]
    _assert_tokens(_complete(client, "a1"), expected["a1"])
    # the same weights under a second name are a second adapter, with the same tokens
    assert _http(base + "/load_lora_adapter", {"lora_name": "a1-again", "lora_path": files["a1"]})[0] == 200
    _assert_tokens(_complete(client, "a1-again"), expected["a1"])
    assert _http(base + "/unload_lora_adapter", {"lora_name": "a1-again"}) == \
        (200, "Success: LoRA adapter 'a1-again' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a1-again")


@pytest.mark.parametrize("route,body,status,param,code", [
    ("load", {}, 400, "lora_name", "invalid_request"),
    ("load", {"lora_name": "x"}, 400, "lora_path", "invalid_request"),
    ("load", {"lora_name": "", "lora_path": "/x"}, 400, "lora_name", "invalid_request"),
    ("load", {"lora_name": 5, "lora_path": "/x"}, 400, "lora_name", "invalid_request"),
    ("load", b"not json", 400, None, "invalid_request"),
    ("load", {"lora_name": "a0", "lora_path": "/x"}, 400, "lora_name", "invalid_request"),  # taken
    ("load", {"lora_name": "tiny", "lora_path": "/x"}, 400, "lora_name", "invalid_request"),  # the base's
    ("load", {"lora_name": "nodir", "lora_path": "/no/such/dir"}, 400, "lora_path", "invalid_adapter"),
    ("load", "bad", 400, "lora_path", "invalid_adapter"),  # a config without weights
    ("unload", {}, 400, "lora_name", "invalid_request"),
    ("unload", {"lora_name": "a9"}, 404, "lora_name", "not_found"),
])
def test_bad_load_and_unload_requests(served, files, route, body, status, param, code):
    if body == "bad":
        body = {"lora_name": "bad", "lora_path": files["bad"]}
    got, data = _http(f"{served[1]}/{route}_lora_adapter", body)
    assert got == status, data
    err = data["error"]
    assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error", err
    if code == "invalid_adapter":
        assert "adapter_model.safetensors" in err["message"] or "adapter_config.json" in err["message"]


def test_load_and_unload_need_the_api_key(served, files):
    for route, body in (("load", {"lora_name": "k", "lora_path": files["a1"]}), ("unload", {"lora_name": "a0"})):
        for key in (None, "wrong"):
            status, data = _http(f"{served[1]}/{route}_lora_adapter", body, key=key)
            assert status == 401 and data["error"]["code"] == "invalid_api_key"
    assert "k" not in [c["id"] for c in _http(served[1] + "/models")[1]["data"]]


def test_unload_waits_for_a_running_stream_then_the_name_is_gone(client, served, files):
    base = served[1]
    assert _http(base + "/load_lora_adapter", {"lora_name": "a2", "lora_path": files["a1"]})[0] == 200
    stream = client.completions.create(model="a2", prompt=PROMPT, max_tokens=1000, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].finish_reason is None
    unloaded: list = []
    unloading = threading.Thread(target=lambda: unloaded.append(_http(base + "/unload_lora_adapter",
                                                                      {"lora_name": "a2"})))
    unloading.start()
    deadline = time.monotonic() + 10
    while "a2" in [m.id for m in client.models.list().data]:  # off the list at once
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert unloading.is_alive(), "the unload must wait for the stream's request to end"
    with pytest.raises(openai.NotFoundError) as info:  # no new request for it meanwhile
        _complete(client, "a2")
    assert info.value.body["code"] == "model_not_found"
    rest = list(chunks)
    finishes = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and rest[-1].usage.completion_tokens == 1000
    unloading.join(30)
    assert unloaded == [(200, "Success: LoRA adapter 'a2' removed successfully.")]
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a2")
    assert "a2" not in [m.id for m in client.models.list().data]


async def test_websocket_params_adapter(served, expected):
    async with Client(served[2], api_key=KEY) as ws:
        events = [ev async for ev in ws.generate(PROMPT, params={"adapter": "a0", "max_tokens": MAX_TOKENS,
                                                                 **GREEDY})]
        assert isinstance(events[-1], Done) and events[-1].finish_reason == "length"
        assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == expected["a0"][0]
        with pytest.raises(RequestError) as info:
            [ev async for ev in ws.generate(PROMPT, params={"adapter": "a9", "max_tokens": 2})]
        assert info.value.code == "not_found" and info.value.param == "adapter" and "'a9'" in str(info.value)


def test_adapters_loaded_at_run_time_survive_a_core_restart(client, served, files, expected):
    """(Last: it kills the engine core.) The new core loads the start-up adapters, then the
    client loads and unloads to serve what was served before."""
    base = served[1]
    assert _http(base + "/load_lora_adapter", {"lora_name": "a3", "lora_path": files["a1"]})[0] == 200
    assert _http(base + "/unload_lora_adapter", {"lora_name": "a0"})[0] == 200  # a start-up one
    before = [m.id for m in client.models.list().data]
    assert "a3" in before and "a0" not in before
    core = engine_core_pid(served[0].pid)
    assert core is not None
    os.kill(core, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while engine_core_pid(served[0].pid) in (core, None):  # until the server has started a new core
        assert time.monotonic() < deadline
        time.sleep(0.1)
    while True:
        status, body = _http(base.removesuffix("/v1") + "/health")
        if status == 200 and body["status"] == "ok" and [m.id for m in client.models.list().data] == before:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.2)
    _assert_tokens(_complete(client, "a3"), expected["a1"])
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a0")


# ---- the same frontend over an in-process engine ----------------------------------------------
async def _inline_server(files, **engine):
    from tokenloom.core.build import config_from_sources
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.plugins import PluginManager
    from tokenloom.protocols.gateway import FrontendHost, ServerOptions

    pm = PluginManager(load_entry_points=False)
    config = config_from_sources(pm, None, None, tiny_engine_kwargs(
        files["model"], frontends={"enabled": ["openai"], "openai": {"port": 0, "served_model_name": "tiny"}},
        **engine))
    host = FrontendHost(AsyncEngine(config, plugin_manager=pm), ServerOptions(api_key=KEY))
    await host.start()
    return host, host.frontends[0].urls()[0]


async def _close(host):
    await host.shutdown(0)
    await host.engine.shutdown()
    host.engine.close()


async def test_in_process_engine_serves_adapters_too(files, expected):
    host, base = await _inline_server(files, adapter={"name": "lora", "modules": {"a0": files["a0"]}})
    try:
        aclient = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)

        async def complete(model):
            return await aclient.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                    logprobs=0, extra_body={"ignore_eos": True})

        async def post(route, body):  # (urllib, on a thread: this loop runs the server)
            return await asyncio.to_thread(_http, f"{base}/{route}_lora_adapter", body)

        _assert_tokens(await complete("a0"), expected["a0"])
        assert await post("load", {"lora_name": "a1", "lora_path": files["a1"]}) == \
            (200, "Success: LoRA adapter 'a1' added successfully.")
        status, data = await post("load", {"lora_name": "b", "lora_path": files["bad"]})
        assert status == 400 and data["error"]["code"] == "invalid_adapter"
        cards = {m.id: m.model_dump() for m in (await aclient.models.list()).data}
        assert list(cards) == ["tiny", "a0", "a1"] and cards["a1"]["root"] == files["a1"]
        _assert_tokens(await complete("a1"), expected["a1"])
        assert (await post("unload", {"lora_name": "a1"}))[0] == 200
        status, data = await post("unload", {"lora_name": "a1"})
        assert status == 404 and data["error"]["code"] == "not_found"
        with pytest.raises(openai.NotFoundError):
            await complete("a1")
    finally:
        await _close(host)


async def test_a_server_without_the_adapter_role_says_how_to_enable_it(files):
    host, base = await _inline_server(files)
    try:
        for route, body in (("load", {"lora_name": "a1", "lora_path": files["a1"]}), ("unload", {"lora_name": "a1"})):
            status, data = await asyncio.to_thread(_http, f"{base}/{route}_lora_adapter", body)
            err = data["error"]
            assert status == 400 and err["code"] == "lora_not_enabled" and "--enable-lora" in err["message"]
        status, data = await asyncio.to_thread(_http, base + "/models")
        assert [m["id"] for m in data["data"]] == ["tiny"]
    finally:
        await _close(host)
