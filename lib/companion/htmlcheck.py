"""Check the built book in a real browser (headless Chromium through chromedriver).

The built HTML is served on 127.0.0.1 (a random free port); every page of the table
of contents is opened and must: load, have every ``<img>`` loaded (naturalWidth > 0),
render its maths with the local MathJax (no script fetched from another host, no TeX
error), show no raw LaTeX in its text (:func:`raw_latex`: ``$...$``, ``$$``, ``\\sqrt``,
``x_{i}`` outside code and maths, i.e. maths the Markdown parser did not recognise),
and log no console error. A screenshot of each page is saved under
``<build>/../screenshots/``.

Outcomes (the exit code of ``python -m companion check-html``, :attr:`Report.exit_code`):
a problem on any page is a failure (1); no built book to check is an error (2); a
missing Chromium or chromedriver *skips* the check (0, so ``make book`` still succeeds
where no browser can be installed), and the summary prints why.
"""
from __future__ import annotations

import contextlib
import functools
import html.parser
import http.server
import re
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


# What is not prose: code, maths (rendered or not), scripts. Raw LaTeX is looked for
# in the rest. The browser check and raw_latex_in_html use the same lists.
EXCLUDED_TAGS = ("pre", "code", "kbd", "samp", "script", "style", "textarea", "svg", "math",
                 "mjx-container")
EXCLUDED_CLASSES = ("math", "highlight", "cell_input", "MathJax", "linenos")
# Block elements end a line of text, so that a pattern cannot span two paragraphs.
BLOCK_TAGS = ("p", "div", "li", "td", "th", "tr", "table", "dt", "dd", "h1", "h2", "h3",
              "h4", "h5", "h6", "figcaption", "caption", "section", "br", "blockquote")

_RAW_LATEX = (
    # "$x$", "$W_O$.": a $ opening before a non-space non-digit and closing after a
    # non-space, not glued to a word or a digit: "$5 and $10", "US$5", "5$" do not match.
    ("$...$", re.compile(r"(?<![\w$\\])\$(?=[^\s$\d])[^$\n]{0,300}?(?<=[^\s$\\])\$(?![\w$])")),
    ("$$", re.compile(r"\$\$")),
    # A TeX command of two or more letters: \sqrt, \frac, \mathbb (not "\n").
    ("\\command", re.compile(r"(?<![\w\\])\\[A-Za-z]{2,}")),
    # A TeX sub- or superscript group: x_{i}, e^{i}.
    ("_{ or ^{", re.compile(r"[\w)\]}][_^]\{")),
)


def raw_latex(text: str) -> list[str]:
    """The pieces of ``text`` (a page's prose, code and maths removed) that look like
    LaTeX left unparsed, each with a little context; empty when there is none.

    >>> raw_latex("the slice of W_O$. The $A^{lh}$ map")
    ['$A^{lh}$ (in: ...f W_O$. The $A^{lh}$ map)']
    >>> raw_latex("It costs $5, or $10 with US$3 of tax, and 5$ is cheap.")
    []
    """
    found = []
    for line in text.split("\n"):
        taken: list[tuple[int, int]] = []  # one finding per stretch of a line
        for _name, pattern in _RAW_LATEX:
            for m in pattern.finditer(line):
                if any(m.start() < hi and lo < m.end() for lo, hi in taken):
                    continue
                taken.append(m.span())
                lo, hi = max(0, m.start() - 12), min(len(line), m.end() + 12)
                context = ("..." if lo else "") + line[lo:hi].strip() + (
                    "..." if hi < len(line) else "")
                piece = m.group(0) if len(m.group(0)) <= 40 else m.group(0)[:37] + "..."
                found.append(f"{piece} (in: {context[:80]})")
    return found


class _ProseText(html.parser.HTMLParser):
    """The text of an HTML page outside code and maths (inside ``<article>`` if any)."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
            "source", "track", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool]] = []  # (tag, excluded)
        self.parts: list[tuple[int, str]] = []  # (article depth, text)
        self.article = 0
        self.has_article = False

    def handle_starttag(self, tag, attrs):
        classes = set((dict(attrs).get("class") or "").split())
        if tag in BLOCK_TAGS:
            self.parts.append((self.article, "\n"))
        if tag in self.VOID:
            return
        excluded = (bool(self.stack) and self.stack[-1][1]) or tag in EXCLUDED_TAGS or bool(
            classes & set(EXCLUDED_CLASSES))
        if tag == "article":
            self.article += 1
            self.has_article = True
        self.stack.append((tag, excluded))

    def handle_endtag(self, tag):
        if tag in BLOCK_TAGS:
            self.parts.append((self.article, "\n"))
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                if tag == "article":
                    self.article -= 1
                break

    def handle_data(self, data):
        if not (self.stack and self.stack[-1][1]):
            self.parts.append((self.article, data))

    def text(self) -> str:
        keep = [s for depth, s in self.parts if depth > 0 or not self.has_article]
        return "".join(keep)


def prose_text(page_html: str) -> str:
    """The text a reader sees outside code and maths (see :data:`EXCLUDED_TAGS`)."""
    parser = _ProseText()
    parser.feed(page_html)
    parser.close()
    return parser.text()


def raw_latex_in_html(page_html: str) -> list[str]:
    r""":func:`raw_latex` of an HTML page's prose (what the browser check applies to the
    rendered page, here on HTML source: a ``<span class="math">`` counts as maths).

    >>> raw_latex_in_html('<p>outputs <span class="math">\\(i\\)</span>, $<span '
    ...                   'class="math">z</span>W_O$.</p><pre>$x$ \\sqrt</pre>')
    ['$W_O$ (in: outputs , $W_O$.)']
    """
    return raw_latex(prose_text(page_html))


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
const texErrors = document.querySelectorAll('mjx-merror').length;
// The prose: the article without code and maths, a line break around every block.
const root = document.querySelector('article') || document.querySelector('main') || document.body;
const clone = root.cloneNode(true);
clone.querySelectorAll(arguments[0]).forEach(e => e.remove());
clone.querySelectorAll(arguments[1]).forEach(e => {
  e.prepend(document.createTextNode('\\n')); e.append(document.createTextNode('\\n'));
});
return {images: imgs.length, bad: bad, mathSource: mathSource, rendered: rendered,
        scripts: scripts, title: document.title, texErrors: texErrors,
        prose: clone.textContent,
        mathjax: !!(window.MathJax && window.MathJax.startup)};
"""
_EXCLUDED_SELECTOR = ", ".join(list(EXCLUDED_TAGS) + [f".{c}" for c in EXCLUDED_CLASSES])
_BLOCK_SELECTOR = ", ".join(BLOCK_TAGS)


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
                state = driver.execute_script(_PAGE_STATE_JS, _EXCLUDED_SELECTOR,
                                              _BLOCK_SELECTOR)
                res.images = state["images"]
                res.math = state["rendered"]
                if state["bad"]:
                    res.problems.append(f"images not loaded: {state['bad'][:5]}")
                if state["mathSource"] and not state["rendered"]:
                    res.problems.append(f"{state['mathSource']} math element(s) not rendered")
                if state["texErrors"]:
                    res.problems.append(f"{state['texErrors']} formula(s) with TeX errors")
                raw = raw_latex(state["prose"])
                if raw:
                    res.problems.append(f"raw LaTeX in the page text (maths not parsed?): "
                                        f"{raw[:3]}")
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
