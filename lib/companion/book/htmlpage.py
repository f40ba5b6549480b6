"""The HTML rules of the browser check, as plain functions of one page's HTML: raw LaTeX
in the prose (:func:`raw_latex`), numbered figures and tables with their Cite lines
(:func:`cite_line_problems`), links to files missing from the build
(:func:`broken_links`), one parameters cell (:func:`parameters_cell_problems`), no local
absolute path (:func:`local_paths`); :func:`page_problems` applies them all from one
parse of the page (:func:`page_tree`). :mod:`companion.book.htmlcheck` applies them to
each page the browser rendered; the tests to small hand-written pages.
"""
from __future__ import annotations

import functools
import html.parser
import re
from pathlib import Path

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


class _Node:
    """An element of :class:`PageTree`: its tag, attributes and, in document order, its
    children (elements and text)."""

    __slots__ = ("tag", "attrs", "children", "parent")

    def __init__(self, tag: str, attrs: dict[str, str], parent: "_Node | None") -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[_Node | str] = []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def iter(self):
        """This element and every element below it, in document order."""
        yield self
        for child in self.children:
            if isinstance(child, _Node):
                yield from child.iter()

    def text_content(self) -> str:
        """The text below this element in document order (scripts and styles left out),
        a line break around every block element so that words of two blocks never join."""
        parts = []
        for child in self.children:
            if isinstance(child, str):
                parts.append(child)
            elif child.tag not in ("script", "style"):
                block = child.tag in BLOCK_TAGS or child.tag == "pre"
                parts += ["\n" if block else "", child.text_content(), "\n" if block else ""]
        return "".join(parts)


class PageTree(html.parser.HTMLParser):
    """A forgiving element tree of a page: enough to find figures, cells and links."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = _Node("#document", {}, None)
        self.open = [self.root]

    def handle_starttag(self, tag, attrs):
        node = _Node(tag, {k: v or "" for k, v in attrs}, self.open[-1])
        self.open[-1].children.append(node)
        if tag not in _ProseText.VOID:
            self.open.append(node)

    def handle_startendtag(self, tag, attrs):
        self.open[-1].children.append(_Node(tag, {k: v or "" for k, v in attrs}, self.open[-1]))

    def handle_endtag(self, tag):
        for i in range(len(self.open) - 1, 0, -1):
            if self.open[i].tag == tag:
                del self.open[i:]
                break

    def handle_data(self, data):
        self.open[-1].children.append(data)


@functools.lru_cache(maxsize=2)
def page_tree(page_html: str) -> _Node:
    """The element tree of ``page_html``, read only: one parse per page serves all the
    checks of :func:`page_problems` and :func:`linked_files` (each parsed the page
    itself: six parses, about 0.9 s of a 450 kB chapter page here, against 0.15 s)."""
    parser = PageTree()
    parser.feed(page_html)
    parser.close()
    return parser.root


def numbered_items(page_html: str) -> list[str]:
    """The ids of the numbered figures and tables of a page (those whose caption has a
    number: Sphinx's ``<span class="caption-number">``), in page order.

    >>> numbered_items('<figure id="f"><figcaption><span class="caption-number">Fig. 1 '
    ...                '</span></figcaption></figure><table id="t"><caption><span '
    ...                'class="caption-number">Table 1</span></caption></table><table id="u">')
    ['f', 't']
    """
    ids = []
    for node in page_tree(page_html).iter():
        if node.tag in ("figure", "table") and node.attrs.get("id") and any(
                "caption-number" in n.classes for n in node.iter()):
            ids.append(node.attrs["id"])
    return ids


def cite_lines(page_html: str) -> dict[str, list[str]]:
    """Every Cite line of a page (``details.cite-line``): the id it cites -> its links."""
    found: dict[str, list[str]] = {}
    for node in page_tree(page_html).iter():
        if node.tag == "details" and "cite-line" in node.classes:
            found[node.attrs.get("data-cite-for", "")] = [
                n.attrs["href"] for n in node.iter() if n.tag == "a" and n.attrs.get("href")]
    return found


#: What a Cite line must link to: (what, file suffix).
_CITE_NEEDS = {"figure": (("PNG", ".png"), ("SVG", ".svg"), ("PDF", ".pdf"),
                          ("provenance", ".json"), ("BibTeX", ".bib")),
               "table": (("CSV", ".csv"), ("provenance", ".json"), ("BibTeX", ".bib"))}


def cite_line_problems(page_html: str, page: str = "", build_dir: Path | None = None
                       ) -> list[str]:
    """What is wrong with the Cite lines of a chapter page: a numbered figure or table
    without one, a line missing one of its links (figures: PNG, SVG, PDF, provenance,
    .bib; tables: CSV, provenance, .bib), and, given the page's path ``page`` in
    ``build_dir``, a link whose file is not in the build. Empty when all is well.

    >>> fig = ('<figure id="f"><figcaption><span class="caption-number">Fig. 1</span>'
    ...        '</figcaption></figure>')
    >>> cite_line_problems(fig)
    ['figure f has no Cite line']
    >>> cite_line_problems(fig + '<details class="cite-line" data-cite-for="f"><summary>'
    ...     + "".join(f'<a href="a/f.{x}">{x}</a>' for x in ("png", "svg", "pdf", "json"))
    ...     + '</summary></details>')
    ['the Cite line of figure f has no BibTeX link (.bib)']
    """
    tree = page_tree(page_html)
    kinds = {}
    for node in tree.iter():
        if node.tag in ("figure", "table") and node.attrs.get("id") and any(
                "caption-number" in n.classes for n in node.iter()):
            kinds[node.attrs["id"]] = node.tag
    lines = cite_lines(page_html)
    problems = []
    for item_id, kind in kinds.items():
        if item_id not in lines:
            problems.append(f"{kind} {item_id} has no Cite line")
            continue
        hrefs = lines[item_id]
        for what, suffix in _CITE_NEEDS[kind]:
            if not any(h.split("#")[0].split("?")[0].endswith(suffix) for h in hrefs):
                problems.append(f"the Cite line of {kind} {item_id} has no {what} link "
                                f"({suffix})")
        if build_dir is not None:
            missing = [h for h in hrefs if _missing_in_build(h, page, Path(build_dir))]
            if missing:
                problems.append(f"the Cite line of {kind} {item_id} links to files missing "
                                f"from the build: {missing[:3]}")
    return problems


def _link_target(href: str, page: str) -> str | None:
    """The path in the build that the relative link ``href`` of ``page`` names (it may
    start with ``..``: outside the build), or None for another site or a link within
    the page."""
    import posixpath
    import urllib.parse

    parts = urllib.parse.urlsplit(href)
    if parts.scheme or parts.netloc or not parts.path:
        return None  # another site, or a link within the page
    return posixpath.normpath(posixpath.join(posixpath.dirname(page),
                                             urllib.parse.unquote(parts.path)))


def _missing_in_build(href: str, page: str, build_dir: Path) -> bool:
    """Whether the relative link ``href`` of ``page`` names no file of the build."""
    target = _link_target(href, page)
    if target is None:
        return False
    return target.startswith("..") or not (build_dir / target).is_file()


def linked_files(page_html: str, page: str) -> list[str]:
    """The files of the build that the relative links of a page (``<a href>``, ``<img
    src>``) name: what :func:`broken_links` and :func:`cite_line_problems` look up
    (the browser check's cache keys their existence).

    >>> linked_files('<a href="../a/b.pdf#p2">b</a><img src="c%20d.png"><a href="#top">t'
    ...              '</a><a href="https://x.org/">x</a>', "book/p.html")
    ['a/b.pdf', 'book/c d.png']
    """
    found = []
    for node in page_tree(page_html).iter():
        attr = {"a": "href", "img": "src"}.get(node.tag)
        link = node.attrs.get(attr or "", "")
        if link and not link.startswith(("#", "data:", "mailto:", "javascript:")):
            target = _link_target(link, page)
            if target is not None and not target.startswith(".."):
                found.append(target)
    return list(dict.fromkeys(found))


def broken_links(page_html: str, page: str, build_dir: Path) -> list[str]:
    """The relative links of a page (``<a href>``, ``<img src>``) that name no file of the
    build at ``build_dir`` (``page`` is the page's path in it); links to other sites and
    within the page are not followed.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as build:
    ...     _ = (Path(build) / "a.png").write_text("x")
    ...     broken_links('<img src="a.png"><a href="b.pdf">b</a><a href="#top">t</a>'
    ...                  '<a href="https://x.org/c">c</a>', "index.html", Path(build))
    ['b.pdf']
    """
    found = []
    for node in page_tree(page_html).iter():
        attr = {"a": "href", "img": "src"}.get(node.tag)
        link = node.attrs.get(attr or "", "")
        if link and not link.startswith(("#", "data:", "mailto:", "javascript:")) and \
                _missing_in_build(link, page, Path(build_dir)):
            found.append(link)
    return list(dict.fromkeys(found))


#: Classes of a code cell that is the chapter's parameters cell (papermill's tags).
PARAMETERS_TAGS = ("tag_parameters", "tag_injected-parameters")


def parameters_cell_problems(page_html: str) -> list[str]:
    """A chapter page shows exactly one parameters cell (a cell tagged ``parameters`` or
    ``injected-parameters``); else the problem, in one sentence.

    >>> cell = '<div class="cell tag_{} docutils container"><pre>seed = 0</pre></div>'
    >>> parameters_cell_problems(cell.format("parameters"))
    []
    >>> parameters_cell_problems(cell.format("parameters") + cell.format("injected-parameters"))
    ['2 parameters cells shown (expected exactly one)']
    """
    count = sum(1 for node in page_tree(page_html).iter()
                if "cell" in node.classes and node.classes & set(PARAMETERS_TAGS))
    if count == 1:
        return []
    return [f"{count} parameters cells shown (expected exactly one)"]


# A local absolute path: a user's or a machine's folder (not a web address: the slash
# must not follow a word character, a dot or another slash, as in https://host/home/).
_LOCAL_PATH = re.compile(
    r"(?<![\w.~/:%-])/(?:tmp|home|root|work|Users|private/var|var/folders|mnt|scratch)"
    r"/[\w.~@+-][^\s\"'<>)\]]*"
    r"|\b[A-Za-z]:\\(?:Users|Documents and Settings)\\[^\s\"'<>]*"
    r"|file:///[^\s\"'<>]*")


def local_paths(page_html: str) -> list[str]:
    """The local absolute paths a page shows in its text (code and outputs included) or
    links to (``href``, ``src``): what a page built on one machine must not leak.

    >>> local_paths('<p>see /work/main/benchmarks/results/sbm.json not found</p>'
    ...             '<a href="https://github.com/home/x">web</a><img src="file:///tmp/a.png">')
    ['/work/main/benchmarks/results/sbm.json', 'file:///tmp/a.png']
    """
    tree = page_tree(page_html)
    found = _LOCAL_PATH.findall(tree.text_content())
    for node in tree.iter():
        for attr in ("href", "src"):
            value = node.attrs.get(attr, "")
            if value and _LOCAL_PATH.match(value):
                found.append(value)
    return list(dict.fromkeys(found))


def page_problems(page_html: str, page: str, build_dir: Path | None = None,
                  chapter_page: bool = False) -> list[str]:
    """The HTML checks of one page (no browser needed): on every page no local path
    and, given ``build_dir``, no relative link to a file missing from the build; on a
    chapter page also the Cite lines and the one parameters cell."""
    problems = []
    paths = local_paths(page_html)
    if paths:
        problems.append(f"local absolute paths in the page: {paths[:3]}")
    if build_dir is not None:
        missing = broken_links(page_html, page, build_dir)
        if missing:
            problems.append(f"links to files missing from the build: {missing[:3]}")
    if chapter_page:
        problems += cite_line_problems(page_html, page, build_dir)
        problems += parameters_cell_problems(page_html)
    return problems


#: The widths the book is checked at: a desktop and a phone.
