"""MkDocs hook (mkdocs.yml `hooks:`): pages that are generated from the code, never copied.

`<!-- generated: CheckpointerConfig -->` in a page becomes the table of every
`CheckpointerConfig` field: name, type, default and its docstring, read from the class.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- generated: CheckpointerConfig -->"


def config_reference() -> str:
    """A Markdown table of every `CheckpointerConfig` field, in declaration order."""
    from trainckpt.checkpointer import CheckpointerConfig

    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, info in CheckpointerConfig.model_fields.items():
        kind = str(info.annotation).replace("typing.", "").replace("pathlib.", "")
        kind = kind.replace("<class '", "").replace("'>", "").replace("|", "\\|")
        meaning = " ".join((info.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | `{kind}` | `{info.default!r}` | {meaning} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs event: fill in the generated parts of a page."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, config_reference())
    return markdown
