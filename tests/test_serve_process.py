"""`tokenloom serve` and `tokenloom chat` as real processes: SIGTERM, exit codes, a chat."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from tokenloom.protocols.websocket.client import Client
from tokenloom.protocols.websocket.messages import Delta

from conftest import start_serve_process

CLI = [sys.executable, "-m", "tokenloom.cli.main"]


@pytest.fixture
def serve_process(tiny_model_dir):
    proc, url = start_serve_process("--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "128",
                                    "--port", "0", "--openai-port", "0", "--shutdown-deadline", "0.2")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def test_sigterm_drains_aborts_and_exits_zero(serve_process):
    proc, url = serve_process
    async with Client(url) as client:
        long = client.generate("long", params={"temperature": 0, "max_tokens": 1000, "ignore_eos": True})
        first = await long.__anext__()
        assert isinstance(first, Delta)
        proc.send_signal(signal.SIGTERM)
        events = [ev async for ev in long]
        assert events[-1].finish_reason == "aborted"
        await asyncio.sleep(0.1)
        assert client._ws.close_code == 1001
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, lambda: proc.wait(timeout=30)) == 0


def test_chat_command_talks_to_the_server(serve_process):
    _, url = serve_process
    res = subprocess.run([*CLI, "chat", "--url", url, "--temperature", "0", "--max-tokens", "8"],
                         input="hello there\nand again\n\n", capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("[length, 8 tokens") == 2
    assert "connected to" in res.stderr
