"""The dashboard in a real headless Chromium (Debian's), against the real server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import orjson
import pytest
from playwright.async_api import async_playwright
from websockets.asyncio.client import connect

from stallfree.gateway.settings import GatewaySettings
from tests.server import sim_server

pytestmark = pytest.mark.slow  # a browser

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def ensure_chromium() -> None:
    """`make setup` installs Debian's Chromium once (never `playwright install`); tests install nothing."""
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: run `make setup` (it installs Debian's chromium)"


@pytest.fixture(scope="module")
def server():
    s = sim_server(time_scale=0.3, token_budget=256, max_num_seqs=64)
    yield s
    s.stop()


class Page:
    """A page plus every console error and uncaught exception it produced."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))


@pytest.fixture
async def browser():
    ensure_chromium()
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        await b.close()


async def open_page(browser, url) -> Page:
    page = Page(await browser.new_page(viewport={"width": 1400, "height": 1300}))
    await page.page.goto(url)
    await page.page.wait_for_function("window.dashboard && window.dashboard.connected", timeout=20000)
    return page


async def run_streams(server, n=4, tokens=60):
    async with connect(server.ws_url) as ws:
        for i in range(n):
            await ws.send(
                orjson.dumps(
                    {
                        "type": "generate",
                        "id": f"s{i}",
                        "prompt": f"stream {i}",
                        "max_tokens": tokens,
                        "ignore_eos": True,
                    }
                ).decode()
            )
        done = 0
        while done < n:
            done += orjson.loads(await ws.recv())["type"] == "done"


async def test_page_loads_and_charts_receive_points(server, browser):
    page = await open_page(browser, server.url + "/")
    await run_streams(server)
    await page.page.wait_for_function("window.dashboard.gapPoints > 50 && window.dashboard.iterations > 20")
    tile = await page.page.inner_text("#p99")
    assert tile.endswith("ms")
    await page.page.wait_for_function("window.dashboard.goodRequests >= 4")
    assert (await page.page.inner_text("#good")).endswith("%")
    assert "TTFT met" in await page.page.inner_text("#good-targets")
    assert await page.page.inner_text("#conn") == "live"
    assert await page.page.is_hidden("#auth")  # no key needed on this server
    assert page.errors == []


async def test_chunking_toggle_changes_the_server_config(server, browser):
    page = await open_page(browser, server.url + "/")
    await page.page.wait_for_function("document.getElementById('budget').value !== ''")
    await page.page.select_option("#chunking", "none")
    await page.page.wait_for_function("document.getElementById('status').textContent.includes('applied: none')")
    cfg = (await asyncio.to_thread(httpx.get, server.url + "/api/config")).json()["scheduler"]
    assert cfg["chunking"] == "none"
    await page.page.fill("#budget", "320")
    await page.page.fill("#tbt", "120")
    await page.page.fill("#ttft", "900")
    await page.page.select_option("#chunking", "stall_free")
    await page.page.click("#apply")
    await page.page.wait_for_function("document.getElementById('status').textContent.includes('budget 320')")
    cfg = (await asyncio.to_thread(httpx.get, server.url + "/api/config")).json()["scheduler"]
    assert (cfg["chunking"], cfg["token_budget"]) == ("stall_free", 320)
    assert (cfg["tbt_slo_ms"], cfg["ttft_slo_ms"]) == (120, 900)
    assert "TBT target 120, TTFT target 900" in await page.page.inner_text("#status")
    await page.page.wait_for_function("document.getElementById('mode').textContent.includes('TTFT 900 ms')")
    assert page.errors == []
    await page.page.fill("#tbt", "-5")
    await page.page.click("#apply")
    await page.page.wait_for_function("document.getElementById('status').textContent.includes('tbt_slo_ms must be')")
    assert all("400 (Bad Request)" in e for e in page.errors)  # the browser logs the refusal, nothing else
    await asyncio.to_thread(
        httpx.put, server.url + "/api/config", json={"token_budget": 256, "tbt_slo_ms": 0, "ttft_slo_ms": 0}
    )


@pytest.mark.parametrize("chunking", ["stall_free", "none", "tbt"])
async def test_demo_shows_the_long_prompt_in_the_iteration_chart(server, browser, chunking):
    tbt_slo_ms = 25.0 if chunking == "tbt" else 0.0
    chunking = "stall_free" if chunking == "tbt" else chunking
    config = {"chunking": chunking, "tbt_slo_ms": tbt_slo_ms}
    await asyncio.to_thread(httpx.put, server.url + "/api/config", json=config)
    page = await open_page(browser, server.url + "/")
    await page.page.click("#demo")
    await page.page.wait_for_function("window.dashboard.demoDone", timeout=120000)
    await page.page.wait_for_timeout(400)  # the last telemetry frame
    d = await page.page.evaluate("window.dashboard")
    assert d["prefillTokens"] > 3000  # the ~3,000-token prompt went through the iteration chart
    assert d["predicted"] > 0  # the cost model's prediction is drawn beside each iteration
    if tbt_slo_ms:
        assert 0 < d["maxPrefillBesideDecodes"] < 200  # while the chats decode, the target cuts the chunks
        assert "25 ms" in await page.page.inner_text("#mode")
    elif chunking == "stall_free":
        assert d["maxPrefill"] <= 256  # spread over chunks within the budget
    else:
        assert d["maxPrefill"] > 2500  # one whole-prompt iteration: the frozen batch
    assert d["stalledPoints"] > 0  # the chats' gaps that overlapped it are marked
    assert "long prompt TTFT" in await page.page.inner_text("#status")
    ARTIFACTS.mkdir(exist_ok=True)
    name = "tbt" if tbt_slo_ms else chunking
    await page.page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)
    assert page.errors == []
    await asyncio.to_thread(httpx.put, server.url + "/api/config", json={"tbt_slo_ms": 0})
    await asyncio.to_thread(httpx.put, server.url + "/api/config", json={"chunking": "stall_free"})


async def test_chat_panel_streams_a_reply(server, browser):
    page = await open_page(browser, server.url + "/")
    await page.page.fill("#chat-input", "Hello there")
    await page.page.press("#chat-input", "Enter")
    await page.page.wait_for_function("window.dashboard.chatReplies === 1", timeout=60000)
    text = await page.page.inner_text("#chat-log")
    assert "you: Hello there" in text and len(text) > len("you: Hello there") + 5
    assert page.errors == []


async def test_with_api_keys_the_page_asks_for_one(browser):
    settings = GatewaySettings(api_keys=("open-sesame",), admin_keys=("operator",))
    server = sim_server(time_scale=0.3, settings=settings)
    try:
        page = Page(await browser.new_page())
        await page.page.goto(server.url + "/")
        await page.page.wait_for_selector("#auth", state="visible", timeout=20000)
        await page.page.fill("#key", "open-sesame")
        await page.page.click("#key-save")
        await page.page.wait_for_function("window.dashboard.connected && window.dashboard.frames > 3")
        await page.page.select_option("#chunking", "decode_first")  # an API key may not: the page asks again
        await page.page.wait_for_function("document.getElementById('status').textContent.includes('operator key')")
        await page.page.wait_for_selector("#auth", state="visible", timeout=20000)
        await page.page.fill("#key", "operator")
        await page.page.click("#key-save")
        await page.page.select_option("#chunking", "none")
        await page.page.select_option("#chunking", "decode_first")
        await page.page.wait_for_function("document.getElementById('status').textContent.includes('applied')")
        cfg = (await asyncio.to_thread(httpx.get, server.url + "/api/config")).json()["scheduler"]
        assert cfg["chunking"] == "decode_first"
        # the only console errors allowed are the refused socket before the key was given, and the refused change
        assert all("WebSocket" in e or "401" in e or "403" in e for e in page.errors), page.errors
    finally:
        server.stop()
