"""The report page in a real browser: Debian's headless Chromium driven over the Chrome
DevTools Protocol (websocket-client). No console errors or exceptions, every image loads,
nothing is fetched but the file itself and its data: URLs, and the screenshots are not
blank. Both a resumed run with training and the embedded default after its CPU stages and
base evaluation (no training: one explanation instead of the training figures)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import numpy as np
import pytest
import websocket
from fixtures.common import make_config
from fixtures.report import RunSpec
from hy3rl import report
from hy3rl.layout import REPORT_FIGURES, REPORT_FILES, Layout
from hy3rl.settings import Config

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--window-size=1280,1600", "--hide-scrollbars"]


class DevTools:
    """A minimal CDP session on one page target: commands, and the events seen so far."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def wait_for(self, event: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events:
                if e["method"] == event:
                    self.events.remove(e)
                    return e
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                self.events.append(msg)
        raise TimeoutError(event)


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[DevTools]:
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} not found: ./install.sh --test installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} not installed (./install.sh --test installs it)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    log = open(profile.parent / "chromium.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 90
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not start: "
                                   + (profile.parent / "chromium.log").read_text()[-2000:])
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        tools = DevTools(pages[0]["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log", "Network"):
            tools.call(f"{domain}.enable")
        yield tools
        tools.ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _config(gpu: bool) -> Config:
    if gpu:
        return make_config(report={"dpi": 60},
                           cluster={"gpu": True, "nodes": 2, "gpus_per_node": 8})
    return make_config(report={"dpi": 60})


def _open(tools: DevTools, page: Path, element: str) -> dict[str, Any]:
    tools.events.clear()
    tools.call("Page.navigate", url=page.resolve().as_uri())
    tools.wait_for("Page.loadEventFired")
    images = json.loads(tools.call("Runtime.evaluate", expression=(
        "JSON.stringify(Array.from(document.images).map(i => ({id: i.id, complete: i.complete,"
        " w: i.naturalWidth, h: i.naturalHeight})))"), returnByValue=True)["result"]["value"])
    shot = tools.call("Page.captureScreenshot", format="png")["data"]
    rect = json.loads(tools.call("Runtime.evaluate", expression=(
        f"(() => {{ const r = document.getElementById('{element}')"
        ".getBoundingClientRect(); return JSON.stringify({x: r.x + window.scrollX,"
        " y: r.y + window.scrollY, w: r.width, h: r.height}); })()"),
        returnByValue=True)["result"]["value"])
    fig_shot = tools.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                          clip={"x": rect["x"], "y": rect["y"], "width": rect["w"],
                                "height": rect["h"], "scale": 1})["data"]
    problems = []
    for e in tools.events:
        p = e.get("params", {})
        if e["method"] == "Runtime.exceptionThrown":
            problems.append(("exception", p["exceptionDetails"].get("text")))
        elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            problems.append(("console", p.get("args")))
        elif e["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
            problems.append(("log", p["entry"].get("text"), p["entry"].get("url")))
    requests = [e["params"]["request"]["url"] for e in tools.events
                if e["method"] == "Network.requestWillBeSent"]
    explanations = tools.call("Runtime.evaluate", expression=(
        "document.querySelectorAll('#training-not-run').length"),
        returnByValue=True)["result"]["value"]
    return {"images": images, "shot": shot, "fig_shot": fig_shot, "problems": problems,
            "requests": requests, "explanations": explanations}


def _not_blank(png_b64: str) -> float:
    img = mpimg.imread(io.BytesIO(base64.b64decode(png_b64)), format="png")[..., :3]
    assert img.shape[0] > 100 and img.shape[1] > 100
    return float(np.std(img))


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("kind", ["resumed-run", "embedded-default"])
def test_page_in_headless_chromium(kind, browser, report_run_factory, tmp_path: Path):
    if kind == "resumed-run":
        results = report_run_factory(RunSpec())
        cfg = _config(gpu=True)
        element, figures = "fig-training-published", len(REPORT_FIGURES)
    else:  # the embedded default: CPU stages and the base evaluation ran, training did not
        results = report_run_factory(RunSpec(eval_tags=("base",)), training=False)
        cfg = _config(gpu=False)
        element, figures = "training-not-run", 2  # the explanation; the evaluation's figures
    layout = Layout.of_results(results)
    report.run(cfg, results=layout,
               outputs={n: Path(layout.report_file(n)) for n, _ in REPORT_FILES})
    page = Path(layout.report_html)
    seen = _open(browser, page, element)
    assert seen["problems"] == []
    assert len(seen["images"]) == figures
    assert ("fig-training-published" in {i["id"] for i in seen["images"]}) == (
        kind == "resumed-run")
    assert seen["explanations"] == (0 if kind == "resumed-run" else 1)
    for img in seen["images"]:
        assert img["complete"] and img["w"] > 200 and img["h"] > 100, img
    # nothing but the page itself (and its embedded data: URLs) was requested
    assert seen["requests"], "no request seen: the Network domain recorded nothing"
    assert all(u == page.resolve().as_uri() or u.startswith("data:") for u in seen["requests"])
    assert _not_blank(seen["shot"]) > 0.05
    assert _not_blank(seen["fig_shot"]) > 0.05
