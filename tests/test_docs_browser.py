"""The rendered documentation site in a headless Chromium: the index, API and performance pages
show the title, furo's navigation (every page of docs/index.md's toctrees), their images
(loaded, non-zero size; at least three plots on the performance page), and no internal link
of theirs is broken.

Marked ``browser`` (``pytest -m browser tests/test_docs_browser.py``). It needs the Python
package ``playwright`` (``pip install playwright``; never ``playwright install``: the test drives
the system's Chromium, ``/usr/bin/chromium`` or ``$TE_JAX_CHROMIUM``) and, unless
``$TE_JAX_DOCS_HTML`` names an HTML build of the site, Sphinx with the ``docs`` extra. Without
them it is skipped, saying what is missing, before anything is built.

The site: ``$TE_JAX_DOCS_HTML`` if set, else a Sphinx build into a cache directory of its own
under the system's temporary directory (never docs/_build, which other builds write), kept
between runs so a run rebuilds only what changed (the first build takes about 20 s on two
cores, a rebuild about 5 s) and locked while in use, so two runs never build over each other.
It is served on 127.0.0.1 on a free port; the browser's requests to other hosts are refused (the
test needs no network). ``$TE_JAX_SCREENSHOT_DIR``: a full-page screenshot of performance.html is
saved there as ``performance.png``."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("TE_JAX_CHROMIUM", "/usr/bin/chromium")
# Headless, and nothing that reaches for the network (without these it stalls where the network
# is closed).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGES = ("index.html", "api.html", "performance.html")
MIN_IMAGES = {"performance.html": 3}
# Wide enough for furo to show its sidebar (it folds it away below 63em).
VIEWPORT = {"width": 1400, "height": 1000}


def _missing() -> str | None:
    """Why the test cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return (
            "the playwright package is not installed (pip install playwright; the test uses "
            "the system Chromium, so no `playwright install`)"
        )
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (install chromium, or set TE_JAX_CHROMIUM)"
    if not os.environ.get("TE_JAX_DOCS_HTML"):
        docs = ("sphinx", "myst_parser", "furo")
        missing = [m for m in docs if importlib.util.find_spec(m) is None]
        if missing:
            return (
                f"{', '.join(missing)} not installed (pip install '.[docs]'), and no prebuilt "
                "site in TE_JAX_DOCS_HTML"
            )
    return None


def _toctree_pages() -> list[str]:
    """The pages docs/index.md's toctrees list (furo's navigation must show each)."""
    text = (ROOT / "docs" / "index.md").read_text()
    pages = []
    for block in re.findall(r"```\{toctree\}\n(.*?)```", text, flags=re.S):
        pages += [
            line.strip()
            for line in block.splitlines()
            if line.strip() and not line.strip().startswith(":")
        ]
    return pages


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """An exclusive lock on ``path`` (a file) for the block: one run builds and serves the
    cached site at a time."""
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def site():
    """The directory of the built HTML site."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    prebuilt = os.environ.get("TE_JAX_DOCS_HTML")
    if prebuilt:
        path = pathlib.Path(prebuilt)
        if not (path / "index.html").is_file():
            pytest.fail(f"TE_JAX_DOCS_HTML={prebuilt}: no index.html there (build the site first)")
        yield path
        return
    key = hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]
    cache = pathlib.Path(tempfile.gettempdir()) / f"te_jax_docs_browser_{os.getuid()}_{key}"
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / "lock"):
        cmd = [sys.executable, "-m", "sphinx", "-q", "-b", "html", "-d", str(cache / "doctrees")]
        cmd += [str(ROOT / "docs"), str(cache / "html")]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.fail(f"the Sphinx build failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        yield cache / "html"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 -- the base class's name
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # The browser drops connections it no longer needs (a page closed mid-transfer).
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def server(site):
    """The site's base URL, served from a thread on 127.0.0.1 (a free port)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def browser(site):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=60_000
        )
        try:
            yield chromium
        finally:
            chromium.close()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


_IMAGES_JS = """() => Array.from(document.images).map(img => {
  const box = img.getBoundingClientRect();
  return {src: img.currentSrc || img.src, complete: img.complete,
          natural: [img.naturalWidth, img.naturalHeight], shown: [box.width, box.height]};
})"""


def test_rendered_pages_in_a_headless_browser(server, browser):
    host = urllib.parse.urlsplit(server).netloc
    toctree = _toctree_pages()
    assert {"getting_started", "performance", "api"} <= set(toctree), toctree
    context = browser.new_context(viewport=VIEWPORT)
    refused = set()

    def route(r):  # the site is local: any other host is refused, not waited for
        if urllib.parse.urlsplit(r.request.url).netloc == host:
            r.continue_()
        else:
            refused.add(r.request.url)
            r.abort()

    context.route("**/*", route)
    problems, links, statuses = [], {}, {}
    try:
        for name in PAGES:
            page = context.new_page()
            response = page.goto(server + name, wait_until="load", timeout=30_000)
            if response is None or response.status != 200:
                problems.append(f"{name}: HTTP {None if response is None else response.status}")
                continue
            title = page.title()
            if "te_jax" not in title:
                problems.append(f"{name}: the title {title!r} does not name te_jax")

            nav = page.locator(".sidebar-tree")
            if nav.count() != 1 or not nav.is_visible():
                problems.append(f"{name}: furo's navigation (.sidebar-tree) is not shown")
            hrefs = page.eval_on_selector_all(".sidebar-tree a", "els => els.map(e => e.href)")
            shown = {urllib.parse.urlsplit(h).path.lstrip("/").removesuffix(".html") for h in hrefs}
            absent = [p for p in toctree if p not in shown]
            if absent:
                problems.append(f"{name}: the navigation lacks {absent}")

            images = page.evaluate(_IMAGES_JS)
            for img in images:
                if not img["complete"] or min(img["natural"]) <= 0 or min(img["shown"]) <= 0:
                    problems.append(f"{name}: image {img['src']} not loaded or empty: {img}")
            if len(images) < MIN_IMAGES.get(name, 0):
                problems.append(f"{name}: {len(images)} images, want >= {MIN_IMAGES[name]}")

            for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"):
                parts = urllib.parse.urlsplit(href)
                if parts.scheme in ("http", "https") and parts.netloc == host:
                    links.setdefault(parts._replace(fragment="").geturl(), name)

            if name == "performance.html" and os.environ.get("TE_JAX_SCREENSHOT_DIR"):
                out = pathlib.Path(os.environ["TE_JAX_SCREENSHOT_DIR"])
                out.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out / "performance.png"), full_page=True)
            page.close()
    finally:
        context.close()

    for url, where in sorted(links.items()):
        statuses[url] = _status(url)
        if statuses[url] != 200:
            problems.append(f"{where}: link {url} returns HTTP {statuses[url]}")
    assert len(links) > len(toctree), sorted(links)  # the navigation's links at least
    assert not problems, "\n".join(problems)
