"""MkDocs hook: a page that is only ``--8<-- "FILE.md"`` (a file of the repository's root, such as
CHANGELOG.md) shows that file with its links to ``docs/PAGE`` made relative to the site.

On GitHub those files link the manual as ``docs/security.md``; inside the site that path does
not exist, and the strict build would fail on it. A link elsewhere stays as written, so the
strict build still reports it.
"""

from __future__ import annotations

import re
from pathlib import Path

INCLUDE = re.compile(r'\A--8<-- "(?P<file>[\w.-]+\.md)"\s*\Z')
DOCS_LINK = re.compile(r"\]\(docs/")


def on_page_markdown(markdown: str, page, config, files) -> str:
    found = INCLUDE.match(markdown)
    if found is None:
        return markdown
    root = Path(config["config_file_path"]).parent
    text = (root / found.group("file")).read_text(encoding="utf-8")
    return DOCS_LINK.sub("](", text)
