"""Check the built book in a real browser (headless Chromium through chromedriver).

The built HTML is served on 127.0.0.1 (a random free port); every page of the table
of contents is opened and must: load, have every ``<img>`` loaded (naturalWidth > 0),
render its maths with the local MathJax (no script fetched from another host), and log
no console error. A screenshot of each page is saved under
``<build>/../screenshots/``.

Outcomes (the exit code of ``python -m companion check-html``, :attr:`Report.exit_code`):
a problem on any page is a failure (1); no built book to check is an error (2); a
missing Chromium or chromedriver *skips* the check (0, so ``make book`` still succeeds
where no browser can be installed), and the summary prints why.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> tuple[str | None, str | None]:
    """Paths of Chromium and chromedriver, or None where missing."""
    browser = next((p for p in map(shutil.which, CHROMIUM_CANDIDATES) if p), None)
    return browser, shutil.which("chromedriver")


def toc_pages(project) -> list[str]:
    """The HTML paths of every page in the table of contents, root first."""
    return [f + ".html" for f in project.toc_files()]


@dataclass
class PageResult:
    page: str
    problems: list[str] = field(default_factory=list)
    images: int = 0
    math: int = 0
    screenshot: str = ""


@dataclass
class Report:
    """What the check found: per-page results, or why it was skipped or could not run."""

    pages: list[PageResult]
    skipped: str = ""  # the check did not run (no browser): not a failure
    error: str = ""  # the check could not run (no built book): a failure

    @property
    def ok(self) -> bool:
        """No page has a problem (True also when the check was skipped)."""
        return not self.error and all(not p.problems for p in self.pages)

    @property
    def exit_code(self) -> int:
        """0 ok or skipped, 1 a page has a problem, 2 nothing to check."""
        if self.error:
            return 2
        return 0 if self.ok else 1

    def summary(self) -> str:
        if self.error:
            return f"check-html error: {self.error}"
        if self.skipped:
            return f"check-html skipped: {self.skipped}"
        lines = []
        for p in self.pages:
            state = "ok" if not p.problems else "FAIL: " + "; ".join(p.problems)
            lines.append(f"{p.page}: {p.images} image(s), {p.math} math element(s) "
                         f"rendered -> {state}")
        lines.append(f"check-html: {sum(not p.problems for p in self.pages)}/{len(self.pages)} "
                     "pages ok; screenshots in " + (str(Path(self.pages[0].screenshot).parent)
                                                   if self.pages else "-"))
        return "\n".join(lines)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output readable
        pass


@contextlib.contextmanager
def serve(folder: Path):
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


_PAGE_STATE_JS = """
const imgs = Array.from(document.images);
const bad = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.getAttribute('src'));
const mathSource = document.querySelectorAll('.math, span.math, div.math').length;
const rendered = document.querySelectorAll('mjx-container').length;
const scripts = Array.from(document.scripts).map(s => s.src).filter(s => s);
return {images: imgs.length, bad: bad, mathSource: mathSource, rendered: rendered,
        scripts: scripts, title: document.title,
        mathjax: !!(window.MathJax && window.MathJax.startup)};
"""


def _driver(browser: str, driver_path: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def check_book(project, build_dir: Path, pages: list[str] | None = None) -> Report:
    """Open every page in headless Chromium and report what is broken (see module doc)."""
    build_dir = Path(build_dir)
    if not (build_dir / "index.html").exists():
        return Report([], error=f"no built book at {build_dir} (run 'make book' first)")
    browser, driver_path = find_browser()
    if not browser or not driver_path:
        return Report([], skipped="chromium/chromedriver not installed (make setup installs "
                                  "them when run as root: apt-get install chromium "
                                  "chromium-driver)")
    pages = pages or toc_pages(project)
    shots = build_dir.parent / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    results = []
    from selenium.webdriver.support.ui import WebDriverWait

    with serve(build_dir) as base:
        driver = _driver(browser, driver_path)
        try:
            for page in pages:
                res = PageResult(page)
                results.append(res)
                if not (build_dir / page).exists():
                    res.problems.append("page missing from the build")
                    continue
                driver.get(f"{base}/{page}")
                WebDriverWait(driver, 30).until(
                    lambda d: d.execute_script("return document.readyState") == "complete")
                # Let MathJax typeset (it runs asynchronously after load).
                with contextlib.suppress(Exception):
                    WebDriverWait(driver, 20).until(lambda d: d.execute_script(
                        "return !window.MathJax || !MathJax.startup || "
                        "!MathJax.startup.promise ? true : "
                        "(window.__mjDone || "
                        "(MathJax.startup.promise.then(() => {window.__mjDone = true}), false))"))
                # Images below the fold: scroll through the page so lazy ones load too.
                driver.execute_script("window.scrollTo(0, document.body.scrollHeight)")
                with contextlib.suppress(Exception):
                    WebDriverWait(driver, 10).until(lambda d: d.execute_script(
                        "return Array.from(document.images).every(i => i.complete)"))
                driver.execute_script("window.scrollTo(0, 0)")
                state = driver.execute_script(_PAGE_STATE_JS)
                res.images = state["images"]
                res.math = state["rendered"]
                if state["bad"]:
                    res.problems.append(f"images not loaded: {state['bad'][:5]}")
                if state["mathSource"] and not state["rendered"]:
                    res.problems.append(f"{state['mathSource']} math element(s) not rendered")
                external = [s for s in state["scripts"] if not s.startswith(base)]
                if external:
                    res.problems.append(f"scripts from other hosts: {external[:3]}")
                if state["mathSource"] and not any("mathjax" in s for s in state["scripts"]):
                    res.problems.append("maths present but the local MathJax is not loaded")
                errors = [e["message"] for e in driver.get_log("browser")
                          if e.get("level") == "SEVERE"]
                if errors:
                    res.problems.append(f"console errors: {errors[:3]}")
                shot = shots / (page.replace("/", "__").removesuffix(".html") + ".png")
                # Full-page screenshot: grow the window to the page's height first.
                height = driver.execute_script("return document.documentElement.scrollHeight")
                driver.set_window_size(1400, min(int(height) + 50, 16000))
                driver.save_screenshot(str(shot))
                driver.set_window_size(1400, 1000)
                res.screenshot = str(shot)
        finally:
            driver.quit()
    return Report(results)
