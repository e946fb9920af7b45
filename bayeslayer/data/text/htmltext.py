"""HTML to text: the visible prose of a page, with only the standard library's :mod:`html.parser`."""

from __future__ import annotations

from html.parser import HTMLParser

_BLOCK_TAGS = {
    "address", "article", "aside", "blockquote", "br", "caption", "dd", "div", "dl", "dt",
    "figcaption", "figure", "footer", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li",
    "main", "ol", "p", "section", "table", "tbody", "td", "th", "thead", "tr", "ul",
}  # fmt: skip
_SKIP_TAGS = {"script", "style", "pre", "head", "title", "nav", "form", "button", "textarea", "noscript"}
_SKIP_CLASSES = {
    "headerlink", "sphinxsidebar", "related", "footer", "highlight", "linenos", "toctree-wrapper",
}  # fmt: skip
_VOID_TAGS = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr",
}  # fmt: skip


class _ProseExtractor(HTMLParser):
    """Collects the visible prose of an HTML page, one paragraph per block element.

    Keeps only the page's main content (``role="main"``, Sphinx's ``div.body``)
    when it has one, and drops code blocks (``<pre>``), scripts, navigation,
    sidebars and Sphinx's ``¶`` header links.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._stack: list[tuple[str, bool, bool]] = []  # (tag, skipping, in_main) after the tag opened
        self.main: list[str] = []
        self.body: list[str] = []
        self.found_main = False

    def _state(self) -> tuple[bool, bool]:
        return (self._stack[-1][1], self._stack[-1][2]) if self._stack else (False, False)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        skipping, in_main = self._state()
        if tag in _BLOCK_TAGS:
            self._text("\n\n", skipping, in_main)
        if tag in _VOID_TAGS:
            return
        attr = dict(attrs)
        classes = set((attr.get("class") or "").split())
        skipping = skipping or tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES)
        if attr.get("role") == "main" or (tag == "div" and "body" in classes) or tag == "main":
            in_main = True
            self.found_main = True
        self._stack.append((tag, skipping, in_main))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCK_TAGS:
            self._text("\n\n", *self._state())

    def handle_endtag(self, tag: str) -> None:
        # Unclosed <p>/<li> are legal HTML: pop up to the matching open tag, if any.
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == tag:
                del self._stack[i:]
                break
        if tag in _BLOCK_TAGS:
            self._text("\n\n", *self._state())

    def handle_data(self, data: str) -> None:
        self._text(data, *self._state())

    def _text(self, data: str, skipping: bool, in_main: bool) -> None:
        if skipping:
            return
        self.body.append(data)
        if in_main:
            self.main.append(data)


def html_to_text(html: str) -> str:
    """The prose of an HTML page: paragraphs separated by one blank line, spaces collapsed.

    Uses only the standard library's :class:`html.parser.HTMLParser`.
    """
    if not isinstance(html, str):
        raise TypeError(f"html must be a str, got {type(html).__name__}")
    parser = _ProseExtractor()
    parser.feed(html)
    parser.close()
    raw = "".join(parser.main if parser.found_main else parser.body)
    paragraphs = (" ".join(block.split()) for block in raw.split("\n\n"))
    return "\n\n".join(p for p in paragraphs if p)
