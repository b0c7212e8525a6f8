"""MkDocs hooks for the site built from docs/ (mkdocs.yml).

The pages link to the repository's other files with ``../`` (benchmark results, plots, the model store), which works
where they are read in place, on a forge or in an editor. Those files are not pages, and mkdocs --strict would fail on
each such link: in the site, an image from outside docs/ becomes its path in a caption and a link its path in code,
named so that the reader finds it in the repository. Every other link is checked as mkdocs checks it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile(r"(!?)\[([^\]]*)\]\(\.\./([^)#\s]+)(#[^)]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def local(m: re.Match[str]) -> str:
        image, text, target = m.group(1), m.group(2), m.group(3)
        if not (ROOT / target).exists():
            return m.group(0)  # left for mkdocs to report
        return f"*{text}: `{target}`*" if image else f"{text} (`{target}`)"

    return OUTSIDE.sub(local, markdown)
