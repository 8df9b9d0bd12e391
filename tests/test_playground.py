"""The playground page (protocols/static/) in a real headless Chromium, against a real
server over the tiny model: chat streaming, Stop, the live engine panel."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from conftest import SlowSteps, engine_stats, wait_idle

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Tell me a long story about a loom."
MAX_TOKENS = 900  # the tiny model's context is 1024; the chat-templated prompt is ~60 tokens
# One fp32 kernel: "dual" times MKL against oneDNN per weight shape at load, which on two
# busy shared cores can take seconds; this page's test is not about kernels.
ENGINE = {"backend": {"name": "torch", "cpu_linear": "mkl"}}


def _browser_or_skip() -> str:
    pytest.importorskip("playwright.async_api", reason="playwright is not installed")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no system Chromium (chromium / chromium-browser) on PATH for Playwright")
    return exe


async def test_playground_chat_stop_and_engine_panel(make_server):
    """Load the page, stream a reply, see the engine panel poll /stats while it runs, press
    Stop and get ``cancelled``; a second turn sends the history; afterwards the engine is
    idle with no KV block in use, the panel says so, and the browser logged no error.

    Artefacts: a full-page screenshot of the end state in
    ``$TOKENLOOM_TEST_ARTIFACTS/playground.png`` (default folder: ``<repo>/test-artifacts/``),
    and one taken mid-stream in ``playground-streaming.png`` beside it."""
    exe = _browser_or_skip()
    from playwright.async_api import async_playwright, expect

    started = time.monotonic()
    server, url = await make_server(engine=ENGINE, plugins=[SlowSteps()])  # the page's Stop lands mid-stream
    page_url = url.replace("ws://", "http://", 1) + "/"
    artifacts = Path(os.environ.get("TOKENLOOM_TEST_ARTIFACTS", REPO_ROOT / "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=exe, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1440, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text} {m.location}"))
            page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))

            await page.goto(page_url)
            await expect(page.locator("#model-name")).to_have_text(server.engine.model_name)
            await expect(page.locator("#conn-status")).to_have_text("connected")
            await expect(page.locator("#send")).to_be_enabled()
            await expect(page.locator("#stop")).to_be_disabled()
            await page.wait_for_function("Number(document.getElementById('engine').dataset.polls) > 0")
            polls_before = int(await page.get_attribute("#engine", "data-polls"))

            # A long generation that no EOS can end early, so Stop has time to land.
            await page.fill("#max-tokens", str(MAX_TOKENS))
            await page.check("#ignore-eos")
            await page.fill("#prompt", PROMPT)
            await page.press("#prompt", "Enter")
            await expect(page.locator("#send")).to_be_disabled()
            await expect(page.locator("#stop")).to_be_enabled()
            await expect(page.locator(".msg.user .text")).to_have_text(PROMPT)

            assistant = page.locator(".msg.assistant").last
            await page.wait_for_function(
                "document.querySelector('.msg.assistant .text').textContent.length > 0")
            # The panel kept polling and saw the request: running or blocks in use.
            await page.wait_for_function(
                """(before) => { const d = document.getElementById('engine').dataset;
                   return Number(d.polls) > before + 1
                          && (Number(d.peakRunning) >= 1 || Number(d.peakUsed) > 0); }""",
                arg=polls_before, timeout=5000)
            await page.screenshot(path=str(artifacts / "playground-streaming.png"), full_page=True)

            await page.click("#stop", force=True)  # force: a no-op, not a hang, had it just ended
            reason = assistant.locator(".finish-reason b")
            await expect(reason).to_be_visible()
            finish = await reason.text_content()
            tokens = int(await assistant.locator(".tokens b").text_content())
            # cancelled is what should happen; length only if the whole run beat the click
            assert finish in ("cancelled", "length"), finish
            if finish == "cancelled":
                assert 0 < tokens < MAX_TOKENS
            await expect(page.locator("#send")).to_be_enabled()
            await expect(page.locator("#stop")).to_be_disabled()
            figures = await assistant.locator(".figures").text_content()
            assert "TTFT" in figures and "TPOT" in figures and "tok/s" in figures
            first_prompt = int(await assistant.locator(".prompt b").text_content())

            # A second turn carries the history: its prompt holds the first exchange (unless
            # the full-length first reply left it no room in the context: then a new chat).
            if finish != "cancelled":
                await page.click("#clear")
            await page.fill("#max-tokens", "8")
            await page.fill("#prompt", "And then?")
            await page.click("#send")
            second = page.locator(".msg.assistant").last
            await expect(second.locator(".finish-reason b")).to_have_text("length")
            assert await second.locator(".tokens b").text_content() == "8"
            if finish == "cancelled":
                second_prompt = int((await second.locator(".prompt b").text_content()).split()[0])
                assert second_prompt > first_prompt + tokens // 2
                assert await page.locator(".msg.user").count() == 2

            assert await page.evaluate("document.getElementById('kv-map').tagName") == "CANVAS"
            strategies = await page.text_content("#strategies")
            assert "continuous" in strategies and "paged" in strategies

            # After the end, the engine is idle, holds no block, and the panel says so.
            assert await wait_idle(server.engine)
            assert (await engine_stats(server.engine))["kv_blocks_used"] == 0
            polls = int(await page.get_attribute("#engine", "data-polls"))
            await page.wait_for_function(  # a poll that began after the engine went idle
                "(n) => Number(document.getElementById('engine').dataset.polls) > n + 1", arg=polls)
            generated = server.engine.stats()["generated_tokens"]
            await expect(page.locator("#stat-generated")).to_have_text(str(generated))
            await expect(page.locator("#kv-used")).to_have_text("0")
            await expect(page.locator("#stat-running")).to_have_text("0")
            await page.screenshot(path=str(artifacts / "playground.png"), full_page=True)
            assert errors == []
        finally:
            await browser.close()
    assert time.monotonic() - started < 30


async def test_playground_api_key(make_server):
    """With an API key set, the page cannot connect or poll /stats without it; typed into
    the key field, it travels as a WebSocket subprotocol and a Bearer header, and works."""
    exe = _browser_or_skip()
    from playwright.async_api import async_playwright, expect

    server, url = await make_server(engine=ENGINE, api_key="s3cret-key")
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=exe, headless=True)
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(url.replace("ws://", "http://", 1) + "/")
            await expect(page.locator("#conn-status")).to_contain_text("disconnected")
            await expect(page.locator("#stats-error")).to_contain_text("API key")
            await expect(page.locator("#send")).to_be_disabled()

            await page.fill("#api-key", "s3cret-key")
            await page.press("#api-key", "Tab")  # change event: store the key, reconnect
            await expect(page.locator("#conn-status")).to_have_text("connected")
            await expect(page.locator("#model-name")).to_have_text(server.engine.model_name)
            await expect(page.locator("#stats-error")).to_be_hidden()
            await page.fill("#max-tokens", "4")
            await page.fill("#prompt", "hi")
            await page.press("#prompt", "Enter")
            reason = page.locator(".msg.assistant .finish-reason b")
            await expect(reason).to_have_text(re.compile("^(length|stop)$"))
            assert await page.evaluate("localStorage.getItem('tokenloom.apiKey')") == "s3cret-key"
            assert errors == []
        finally:
            await browser.close()
    assert await wait_idle(server.engine)
