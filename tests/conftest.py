"""Shared fixtures: a tiny random-weight LLaMA saved as a Hugging Face directory, with a
byte-level tokenizer (one token per byte, so UTF-8 splitting is exercised for real)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# The repository's top-level folders are tokenloom's subpackages (tokenloom.kernels, ...), not
# top-level packages. `python -m pytest` puts the working directory first on sys.path, where
# kernels/ would shadow Hugging Face's `kernels` package, which transformers (5.x) imports
# with its model classes; tests import tokenloom as installed, never from the root.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

# Tests never auto-load installed plugins; the plugin test turns it on explicitly.
os.environ.setdefault("TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tokenloom.core.hookspecs import hookimpl  # noqa: E402

torch.set_num_threads(2)

TINY_VOCAB = 260  # 256 byte tokens + 4 specials
EOS_ID = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")])
    return tok


class SlowSteps:
    """A plugin whose observer hook sleeps 5 ms on the loop after every engine step, so a
    long request runs for seconds however fast the machine decodes (the tiny model alone
    decodes ~3,000 tokens a second): for tests that must act on a request mid-stream."""

    def __init__(self, seconds: float = 0.005):
        self.seconds = seconds

    @hookimpl
    def step_finished(self, stats):
        time.sleep(self.seconds)


def make_tiny_llama(path, *, seed: int = 0, num_layers: int = 2, tie: bool = False):
    """Save a random LlamaForCausalLM (HF transformers) plus tokenizer files to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, rope_theta=50000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=tie, bos_token_id=257, eos_token_id=EOS_ID)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits than the default init, so greedy ties are rare
        model.lm_head.weight.mul_(8.0) if not tie else None
    model.save_pretrained(path, safe_serialization=True)
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}))
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture
def one_thread(request):
    """One torch intra-op thread for the test; engines built in it keep it (their step threads
    start with it). Use it where the tensors are the tiny models': they gain nothing from a
    second thread, and on a shared 2-core machine two OpenMP threads that wait on each other's
    barriers while other work holds a core made such steps 2-10x slower (a masked SDPA of the
    kit model: ~30 us on one thread, milliseconds on two under load). Tests marked ``slow``
    (the embedded model, whose matmuls do gain from two threads) keep the default.
    ``pytestmark = pytest.mark.usefixtures("one_thread")`` puts a module's tests on it."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread_module():
    """:func:`one_thread` for a whole module, its module-scoped fixtures included (an engine
    the module's tests share, built on the thread count they run on); slow tests too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_engine_kwargs(model_dir, **overrides):
    kwargs = {"model": str(model_dir), "dtype": "float32", "device": "cpu", "num_kv_blocks": 256,
              "block_size": 16}
    kwargs.update(overrides)
    return kwargs


@pytest.fixture
def make_llm(tiny_model_dir):
    from tokenloom import LLM

    made = []

    def factory(**overrides):
        llm = LLM(**tiny_engine_kwargs(tiny_model_dir, **overrides))
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        llm.close()


def pytest_configure(config):
    from tokenloom.core.logging import configure_logging

    configure_logging("WARNING", "console")


@pytest.fixture
async def make_server(tiny_model_dir):
    """Start a real WebSocket server on a loopback port over a tiny-model engine:
    ``await make_server(engine={...}, plugins=[...], **ServerOptions)`` -> (server, url)."""
    from tokenloom.core.build import config_from_sources
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.plugins import PluginManager
    from tokenloom.protocols.websocket.server import ServerOptions, TokenServer

    made = []

    async def factory(**opts):
        engine_kw = opts.pop("engine", {})
        plugins = opts.pop("plugins", ())
        pm = PluginManager(load_entry_points=False, extra=plugins)
        config = config_from_sources(pm, None, None, tiny_engine_kwargs(tiny_model_dir, **engine_kw))
        if SEPARATE and not plugins:  # (in-process plugins cannot cross to the core process)
            from tokenloom.core.engine_process import EngineClient

            engine = await EngineClient.start(config, pm, log_level="WARNING")
        else:
            engine = AsyncEngine(config, plugin_manager=pm)
        server = TokenServer(engine, ServerOptions(port=0, **opts))
        await server.start()
        made.append(server)
        return server, f"ws://127.0.0.1:{server.port}"

    yield factory
    for server in made:
        await server.shutdown(deadline_s=0)
        await server.engine.shutdown()
        if hasattr(server.engine, "aclose"):
            await server.engine.aclose()
        else:
            server.engine.close()


#: TOKENLOOM_TEST_ENGINE_PROCESS=separate runs the server fixtures' engines in their own process
SEPARATE = os.environ.get("TOKENLOOM_TEST_ENGINE_PROCESS") == "separate"


def engine_core_pid(server_pid: int, wait_s: float = 0.0) -> int | None:
    """The pid of the engine core a `tokenloom serve` process ``server_pid`` spawned (its child
    running ``spawn_main``), looked for until ``wait_s`` has passed; None if there is none."""
    deadline = time.monotonic() + wait_s
    while True:
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == server_pid and b"spawn_main" in cmdline:
                return int(entry)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def start_serve_process(*args: str, url: str = r"ws://127\.0\.0\.1:\d+"):
    """``tokenloom serve ARGS`` as a real process: (process, its WebSocket URL, or the first
    match of ``url`` instead), read from the banner on its stderr (the process keeps running;
    the caller ends it)."""
    import re
    import subprocess
    import sys

    env = {**os.environ, "TOKENLOOM_LOG_FORMAT": "json"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli.main", "serve", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stderr:
        m = re.search(f"({url})", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    proc.wait()
    raise AssertionError("server did not start")


async def collect(client, prompt=None, **kw):
    """Run one request through a protocol Client: (text, final event, all events)."""
    from tokenloom.protocols.websocket.messages import Delta

    events = [ev async for ev in client.generate(prompt, **kw)]
    return "".join(e.text for e in events if isinstance(e, Delta)), events[-1], events


async def wait_idle(engine, timeout=5.0):
    """Poll until the engine holds no request and no KV block is in use."""
    import asyncio

    for _ in range(int(timeout / 0.01)):
        if engine.num_unfinished == 0 and (await engine_stats(engine))["kv_blocks_used"] == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def engine_stats(engine) -> dict:
    """The engine's current stats, wherever its core runs (in this process or its own)."""
    await engine.refresh_stats()
    return engine.stats()


def quant_kernel(bits: int) -> str:
    """The kernel-name prefix a 4- or 8-bit weight gets on this machine: the C++
    ``quant_matmul`` where the CPU ops build, torch's int4pack / int8pack kernels otherwise."""
    from tokenloom.kernels import cpu_ops

    if cpu_ops.load() is not None:
        return f"quant_matmul int{bits}"
    return "int4pack_mm" if bits == 4 else "int8pack_mm"
