"""Check the built book in a real browser (headless Chromium through chromedriver).

The built HTML is served on 127.0.0.1 (a random free port); every page of the table
of contents is opened and must: load, have every ``<img>`` loaded (naturalWidth > 0),
render its maths with the local MathJax (no script fetched from another host, no TeX
error), show no raw LaTeX in its text (:func:`raw_latex`: ``$...$``, ``$$``, ``\\sqrt``,
``x_{i}`` outside code and maths, i.e. maths the Markdown parser did not recognise),
and log no console error. At 1400 px and at 400 px of width no page may scroll sideways,
and the report's summary and the figure index fit without a scroll bar of their own
(:func:`sideways_problem`, :data:`MUST_FIT`). No relative link or image of a page may
name a file missing from the build (:func:`broken_links`). On a chapter page
(``book/_generated/chapters/``) every numbered figure and table has its Cite line and
the line's links resolve in the build (:func:`cite_line_problems`), and there is exactly
one parameters cell (:func:`parameters_cell_problems`). No page's text or links show a
local absolute path (:func:`local_paths`: ``/tmp/...``, ``/home/...``, ``/root/...``,
``/work/...``, ``/Users/...``). The HTML checks are plain functions of the page's
HTML (:mod:`companion.book.htmlpage`), tested on small hand-written pages; the browser
applies them to the rendered page (``page_source``).
Screenshots of each page at both widths are saved under ``<build>/../screenshots/``.

A page that passed is not opened again while nothing it read has changed: its HTML, the
bytes of every file the browser loaded for it, whether the files its links name exist,
the checker's code and the Chromium, chromedriver and selenium versions
(:mod:`companion.book.htmlcheck_cache`; ``check_book(cache=...)``, which
``python -m companion check-html`` passes; ``--force`` opens every page).

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from companion._validate import check_number
from companion.book import htmlpage
from companion.book.htmlpage import (  # noqa: F401 - re-exported: the check's HTML rules
    BLOCK_TAGS, EXCLUDED_CLASSES, EXCLUDED_TAGS, broken_links, cite_line_problems, cite_lines,
    linked_files, local_paths, numbered_items, page_problems, parameters_cell_problems,
    prose_text, raw_latex, raw_latex_in_html
)

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> tuple[str | None, str | None]:
    """Paths of Chromium and chromedriver, or None where missing."""
    browser = next((p for p in map(shutil.which, CHROMIUM_CANDIDATES) if p), None)
    return browser, shutil.which("chromedriver")


def toc_pages(project) -> list[str]:
    """The HTML paths of every page in the table of contents, root first."""
    return [f + ".html" for f in project.toc_files()]


WIDTHS = (1400, 400)

_SIDEWAYS_JS = """
const w = window.innerWidth;
const de = document.documentElement;
const width = Math.max(de.scrollWidth, document.body ? document.body.scrollWidth : 0);
const out = new Set();
if (width > w) {
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (!(r.width > 0 && r.right > w + 1)) continue;
    let p = el.parentElement, clipped = false;
    while (p && p !== document.body) {
      const s = getComputedStyle(p);
      if (s.overflowX !== 'visible' || s.position === 'fixed') { clipped = true; break; }
      p = p.parentElement;
    }
    if (!clipped && getComputedStyle(el).position !== 'fixed') out.add(el);
  }
}
const leaves = Array.from(out).filter(e => !Array.from(out).some(o => o !== e && e.contains(o)));
const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') +
  (e.classList.length ? '.' + Array.from(e.classList).slice(0, 2).join('.') : '') +
  ' (right edge ' + Math.round(e.getBoundingClientRect().right) + ' px)';
// Boxes that must fit without scrolling even inside their own box (arguments[0]).
const boxes = Array.from(document.querySelectorAll(arguments[0]))
  .filter(e => e.scrollWidth > e.clientWidth + 1)
  .map(e => name(e) + ' scrolls ' + (e.scrollWidth - e.clientWidth) + ' px');
// Captions and figures must be seen whole: none may reach past the screen or past the
// visible part of a box that scrolls (a caption as wide as its scrolling table is cut).
const clipped = [];
for (const el of document.querySelectorAll(arguments[1])) {
  const r = el.getBoundingClientRect();
  if (!(r.width > 0 && r.height > 0)) continue;
  let left = 0, right = w, p = el.parentElement;
  while (p && p !== document.body) {
    const s = getComputedStyle(p);
    if (s.overflowX !== 'visible') {
      const pr = p.getBoundingClientRect();
      left = Math.max(left, pr.left); right = Math.min(right, pr.right);
    }
    p = p.parentElement;
  }
  if (r.right > right + 1 || r.left < left - 1) {
    clipped.push(name(el) + ' shows ' + Math.round(Math.min(r.right, right) -
      Math.max(r.left, left)) + ' of ' + Math.round(r.width) + ' px');
  }
}
return {scrollWidth: width, innerWidth: w, offenders: leaves.slice(0, 4).map(name),
        boxes: boxes.slice(0, 4), clipped: clipped.slice(0, 4)};
"""

#: What a reader must see whole at every width: captions and figures (their images).
MUST_SHOW_WHOLE = "caption, figcaption, figure img, div.figure img"

#: What must fit the screen without a scroll bar of its own: the report's summary table
#: and the figure index (a reader on a phone reads them whole).
MUST_FIT = (".report-summary .pst-scrollable-table-container", "table.figure-index")


def sideways_problem(state: dict, width: int) -> str:
    """The problem to report when a page scrolls sideways at ``width`` px, or a box of
    :data:`MUST_FIT` scrolls in itself, from what :data:`_SIDEWAYS_JS` measured
    (``scrollWidth``, ``innerWidth``, ``offenders``, ``boxes``); empty when all fits.

    >>> sideways_problem({"scrollWidth": 400, "innerWidth": 400, "offenders": []}, 400)
    ''
    >>> sideways_problem({"scrollWidth": 612, "innerWidth": 400, "offenders": ["pre"]}, 400)
    "scrolls sideways at 400 px (content 612 px wide): ['pre']"
    >>> sideways_problem({"scrollWidth": 400, "innerWidth": 400, "offenders": [],
    ...                   "boxes": ["table.figure-index scrolls 31 px"]}, 400)
    "does not fit at 400 px: ['table.figure-index scrolls 31 px']"
    >>> sideways_problem({"scrollWidth": 400, "innerWidth": 400, "offenders": [],
    ...                   "clipped": ["caption shows 360 of 702 px"]}, 400)
    "cut off at 400 px: ['caption shows 360 of 702 px']"
    """
    problems = []
    if state["scrollWidth"] > state["innerWidth"]:
        problems.append(f"scrolls sideways at {width} px (content {state['scrollWidth']} px "
                        f"wide): {state['offenders']}")
    if state.get("boxes"):
        problems.append(f"does not fit at {width} px: {state['boxes']}")
    if state.get("clipped"):
        problems.append(f"cut off at {width} px: {state['clipped']}")
    return "; ".join(problems)


@dataclass
class PageResult:
    page: str
    problems: list[str] = field(default_factory=list)
    images: int = 0
    math: int = 0
    screenshot: str = ""  # at the first of WIDTHS
    screenshots: dict[int, str] = field(default_factory=dict)  # width -> file
    unchanged_since: str = ""  # not opened: passed at this time, nothing it read changed
    why_opened: str = ""  # with a cache: why the page was checked in the browser


@dataclass
class Report:
    """What the check found: per-page results, or why it was skipped or could not run."""

    pages: list[PageResult]
    skipped: str = ""  # the check did not run (no browser): not a failure
    error: str = ""  # the check could not run (no built book): a failure
    notes: list[str] = field(default_factory=list)  # e.g. an unreadable cache file ignored

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
        from companion.book.htmlcheck_cache import since_text

        if self.error:
            return f"check-html error: {self.error}"
        if self.skipped:
            return f"check-html skipped: {self.skipped}"
        lines = list(self.notes)
        for p in self.pages:
            state = "ok" if not p.problems else "FAIL: " + "; ".join(p.problems)
            if p.unchanged_since:
                state += " (unchanged since it passed, not re-opened)"
            lines.append(f"{p.page}: {p.images} image(s), {p.math} math element(s) "
                         f"rendered -> {state}")
        unchanged = [p.unchanged_since for p in self.pages if p.unchanged_since]
        if unchanged:
            lines.append(f"check-html: {len(unchanged)} page(s) unchanged since "
                         f"{since_text(unchanged)}, not re-opened (--force re-checks them)")
        opened = [(p.page, p.why_opened) for p in self.pages if p.why_opened]
        if opened:
            lines.append(f"check-html: {len(opened)} page(s) opened in the browser: "
                         + _by_reason(opened))
        shots = [p.screenshot for p in self.pages if p.screenshot]
        lines.append(f"check-html: {sum(not p.problems for p in self.pages)}/{len(self.pages)} "
                     "pages ok; " + (f"screenshots in {Path(shots[0]).parent}" if shots
                                     else "no screenshots saved"))
        return "\n".join(lines)


def _by_reason(pages: list[tuple[str, str]]) -> str:
    """``reason: page, page; reason: page`` from (page, reason) pairs.

    >>> _by_reason([("a.html", "new"), ("b.html", "its HTML changed"), ("c.html", "new")])
    'new: a.html, c.html; its HTML changed: b.html'
    """
    grouped: dict[str, list[str]] = {}
    for page, reason in pages:
        grouped.setdefault(reason, []).append(page)
    return "; ".join(f"{reason}: {', '.join(names)}" for reason, names in grouped.items())


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output readable
        pass


    def log_request(self, code="-", size="-") -> None:
        log = getattr(self.server, "request_log", None)
        if log is not None:  # every answered request, a missing file's too
            log.append(self.path)


@contextlib.contextmanager
def serve(folder: Path, request_log: list[str] | None = None):
    """Serve ``folder`` on 127.0.0.1 at a free port (yields the base URL); the path of
    every request answered is appended to ``request_log`` when given."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.request_log = request_log
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
# Every file this document loaded, from the browser's cache too (the buffer is made
# large enough at each document's start: _RESOURCE_BUFFER_JS).
_RESOURCES_JS = """
return [document.URL].concat(performance.getEntriesByType('resource').map(e => e.name));
"""
_RESOURCE_BUFFER_JS = "performance.setResourceTimingBufferSize(1000000);"
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
                 f"--window-size={WIDTHS[0]},1000", "--hide-scrollbars"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def _set_viewport(driver, width: int, height: int) -> None:
    """Lay the page out at exactly ``width`` x ``height`` CSS pixels (a window cannot be
    made 400 px narrow on every platform; the DevTools override can), then wait for
    two animation frames so that the new layout is in place."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": int(width), "height": int(height), "deviceScaleFactor": 1, "mobile": False})
    driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "requestAnimationFrame(() => requestAnimationFrame(() => done(true)));")


PAGE_WAIT_LIMIT_S = 300  # see _load


def _load(driver, url: str, poll_seconds: float = 0.05) -> None:
    """Open ``url`` and wait until it is complete: loaded, its maths typeset by MathJax
    (asynchronous, and it changes the layout), its lazy images below the fold loaded.
    Each wait checks its condition every ``poll_seconds``."""
    from selenium.common.exceptions import TimeoutException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def wait(seconds):
        return WebDriverWait(driver, seconds, poll_frequency=poll_seconds)

    def until(what, condition):
        # a safety limit, far above a loaded machine's seconds: past it the page is
        # reported as not loaded rather than checked half typeset
        try:
            wait(PAGE_WAIT_LIMIT_S).until(condition)
        except TimeoutException:
            raise RuntimeError(f"{url}: {what} after {PAGE_WAIT_LIMIT_S} s") from None
        except WebDriverException:  # a failing script: the checks report the page
            pass

    driver.get(url)
    until("the page had not loaded",
          lambda d: d.execute_script("return document.readyState") == "complete")
    until("MathJax had not typeset the page", lambda d: d.execute_script(
        "return !window.MathJax || !MathJax.startup || "
        "!MathJax.startup.promise ? true : "
        "(window.__mjDone || "
        "(MathJax.startup.promise.then(() => {window.__mjDone = true}), false))"))
    driver.execute_script("window.scrollTo(0, document.body.scrollHeight)")
    until("its images had not loaded", lambda d: d.execute_script(
        "return Array.from(document.images).every(i => i.complete)"))
    driver.execute_script("window.scrollTo(0, 0)")


def is_chapter_page(page: str) -> bool:
    """Whether ``page`` (a path in the build) is an executed chapter's page."""
    return "_generated/chapters/" in page


def check_book(project, build_dir: Path, pages: list[str] | None = None, *,
               screenshots: bool = True, poll_seconds: float = 0.05,
               cache: str | Path | None = None, force: bool = False,
               echo: Callable[[str], None] | None = None) -> Report:
    """Open every page in headless Chromium and report what is broken (see module doc).

    ``screenshots=False`` runs every check (both widths included) without saving the
    full-page screenshots, which take about half the time (the test suite's smoke book;
    ``make check-html`` keeps them, for a person to look at).

    ``poll_seconds``: how often a wait of a page load (loaded, maths typeset, images in)
    checks its condition. Selenium's default, 0.5 s, left every load waiting about half
    a second after MathJax had finished (its first check starts the wait for MathJax's
    promise, the next one sees it): 16 loads of the smoke book took 7 s longer. The
    same checks and the same report at any value. A page that has not loaded, typeset
    its maths or loaded its images after ``PAGE_WAIT_LIMIT_S`` (a safety limit) raises a
    RuntimeError naming it, rather than being checked half done.

    ``cache``: the file of passing checks (:func:`companion.book.htmlcheck_cache.cache_file`
    of the build; None, the default: no cache). A page unchanged since its recorded pass
    is reported passed without being opened (``unchanged_since``; with ``screenshots``,
    its screenshots must still be there); the others are opened (``why_opened``), and
    when the check has run to its end the passes are recorded and the failures removed.
    No browser is started when every page is unchanged. ``force`` opens every page (and
    records the result). ``echo`` receives a line saying how many pages are opened.
    """
    from companion.book import htmlcheck_cache as hc
    from companion.book.interrupts import raise_if_interrupted, signals_deferred

    poll_seconds = check_number("poll_seconds", poll_seconds, minimum=0.0, min_open=True)
    build_dir = Path(build_dir)
    if not (build_dir / "index.html").exists():
        return Report([], error=f"no built book at {build_dir} (run 'make book' first)")
    browser, driver_path = find_browser()
    if not browser or not driver_path:
        return Report([], skipped="chromium/chromedriver not installed (make setup installs "
                                  "them when run as root: apt-get install chromium "
                                  "chromium-driver)")
    pages = pages or toc_pages(project)
    notes: list[str] = []
    store = None
    unchanged: dict[str, hc.CachedPass] = {}
    why: dict[str, str] = {}
    if cache is not None:
        try:
            fingerprint = hc.checker_fingerprint(
                hc.tool_versions(browser, driver_path),
                [Path(__file__), Path(htmlpage.__file__), Path(hc.__file__)])
        except RuntimeError as exc:
            notes.append(f"check-html: no cache of passing checks ({exc}): every page is "
                         "checked in the browser")
        else:
            store, note = hc.CheckCache.load(Path(cache), build_dir, fingerprint)
            notes += [note] if note else []
            states = hc.FileStates(build_dir)
            for page in pages:
                entry, reason = (None, "--force") if force else store.lookup(
                    page, states, screenshots=screenshots)
                if entry is not None:
                    unchanged[page] = entry
                else:
                    why[page] = reason
    to_open = [p for p in pages if p not in unchanged]
    if echo and store is not None and to_open:  # (the summary says why)
        echo(f"check-html: opening {len(to_open)} of {len(pages)} page(s) in the browser, "
             f"{len(unchanged)} unchanged since they passed")
    before = {}
    if store is not None:  # the pages' bytes as they were when checked
        states = hc.FileStates(build_dir)
        before = {p: states.content(p) for p in to_open}
    started = time.time() - hc.CLOCK_MARGIN_S
    reads: dict[str, hc.PageReads] = {}
    opened = {}
    if to_open:
        checked = hc.now_utc()
        for res in _open_pages(browser, driver_path, build_dir, to_open, reads,
                               screenshots=screenshots, poll_seconds=poll_seconds):
            res.why_opened = why.get(res.page, "")
            opened[res.page] = res
    results = []
    for page in pages:
        if page in opened:
            results.append(opened[page])
            continue
        entry = unchanged[page]
        shots = {int(w): s[0] for w, s in entry.screenshots.items()}
        results.append(PageResult(page, images=entry.images, math=entry.math,
                                  screenshot=shots.get(WIDTHS[0], ""), screenshots=shots,
                                  unchanged_since=entry.checked))
    if store is not None and opened:
        raise_if_interrupted()  # an interrupt, even one swallowed on the way: no record
        states = hc.FileStates(build_dir)
        for page, res in opened.items():
            read = reads.get(page, hc.PageReads())
            if res.problems:
                store.forget(page)
            elif read.external:
                notes.append(f"check-html: {page} loaded files from other hosts "
                             f"({sorted(read.external)[:2]}): its pass is not recorded")
            elif states.content(page) != before.get(page) or states.modified_since(
                    read.loaded | read.linked, started):
                notes.append(f"check-html: {page} changed while it was checked: its pass "
                             "is not recorded")
            elif missing := states.missing(read.loaded | read.linked):
                # a pass read them, so they were there: removed during the check (a key
                # with them "missing" would pass a page whose links are now broken)
                notes.append(f"check-html: {page}: {missing[:2]} not there now (removed "
                             "while it was checked?): its pass is not recorded")
            else:
                store.record(page, states.of(read.loaded | {page}, read.linked),
                             res.images, res.math, res.screenshots, checked)
        with signals_deferred():
            store.save()
    return Report(results, notes=notes)


def _record_loads(driver, base: str, read) -> None:
    """Add what the current document loaded (its resource timing) to ``read``."""
    from companion.book import htmlcheck_cache as hc

    for url in driver.execute_script(_RESOURCES_JS) or []:
        rel = hc.build_path(url, base)
        if rel is not None:
            read.loaded.add(rel)
        elif not hc.is_local_url(url, base):
            read.external.add(url)


def _open_pages(browser: str, driver_path: str, build_dir: Path, pages: list[str],
                reads: dict, *, screenshots: bool, poll_seconds: float) -> list[PageResult]:
    """Check ``pages`` in one headless Chromium (the checks of the module doc); what
    each page's check read goes into ``reads[page]`` (a PageReads)."""
    from companion.book import htmlcheck_cache as hc

    shots = build_dir.parent / "screenshots"
    if screenshots:
        shots.mkdir(parents=True, exist_ok=True)
    results = []
    requests: list[str] = []
    with serve(build_dir, requests) as base:
        driver = _driver(browser, driver_path)
        try:
            driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                   {"source": _RESOURCE_BUFFER_JS})
            for page in pages:
                res = PageResult(page)
                results.append(res)
                read = reads.setdefault(page, hc.PageReads())
                if not (build_dir / page).exists():
                    res.problems.append("page missing from the build")
                    continue
                first_request = len(requests)
                _set_viewport(driver, WIDTHS[0], 1000)
                _load(driver, f"{base}/{page}", poll_seconds)
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
                source = driver.page_source
                res.problems += page_problems(source, page, build_dir,
                                              chapter_page=is_chapter_page(page))
                read.linked.update(linked_files(source, page))
                errors = [e["message"] for e in driver.get_log("browser")
                          if e.get("level") == "SEVERE"]
                if errors:
                    res.problems.append(f"console errors: {errors[:3]}")
                stem = page.replace("/", "__").removesuffix(".html")
                for width in WIDTHS:
                    if width != WIDTHS[0]:  # a fresh load at each width, as a phone sees it
                        _set_viewport(driver, width, 1000)
                        _load(driver, f"{base}/{page}", poll_seconds)
                    problem = sideways_problem(
                        driver.execute_script(_SIDEWAYS_JS, ", ".join(MUST_FIT),
                                              MUST_SHOW_WHOLE), width)
                    if problem:
                        res.problems.append(problem)
                    if screenshots:
                        # Full-page screenshot: the viewport as tall as the page.
                        height = driver.execute_script(
                            "return document.documentElement.scrollHeight")
                        _set_viewport(driver, width, min(int(height) + 50, 16000))
                        shot = shots / (stem + ("" if width == WIDTHS[0] else f"@{width}")
                                        + ".png")
                        driver.save_screenshot(str(shot))
                        res.screenshots[width] = str(shot)
                    _record_loads(driver, base, read)
                res.screenshot = res.screenshots.get(WIDTHS[0], "")
                # what the server was asked for meanwhile (a late request of this page
                # may land on the next one: more files in its key, never fewer)
                read.loaded.update(
                    p for p in (hc.build_path(base + r, base) for r in requests[first_request:])
                    if p is not None)
        finally:
            driver.quit()
    return results
