"""One self-contained HTML page: sections of figures (PNG data URIs), tables, notes and collapsible text. No script
and no external resource; a Content-Security-Policy that allows only inline styles and data: images makes the
browser refuse anything else, so the page opens the same offline. Every text is escaped.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.report.charts import Image

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1000px;
       padding: 1em 1.5em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd;
       padding-bottom: 0.2em; margin-top: 1.6em; }
nav a { margin-right: 1em; } .status { color: #555; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
details { margin: 0.6em 0; } summary { cursor: pointer; font-weight: 600; }
pre { background: #f7f7f7; padding: 0.8em; overflow: auto; font-size: 0.8em; max-height: 40em; }
p.note { color: #555; font-style: italic; }
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


@dataclass
class Section:
    id: str
    title: str
    parts: list[str] = field(default_factory=list)
    figure_ids: list[str] = field(default_factory=list)

    def figure(self, fig_id: str, image: Image, alt: str, caption: str = "") -> None:
        self.figure_ids.append(fig_id)
        cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
        self.parts.append(f'<figure id="{esc(fig_id)}"><img src="{image.uri}" alt="{esc(alt)}" width="{image.width}" '
                          f'height="{image.height}">{cap}</figure>')

    def table(self, table_id: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        """A table; no header row when `header` is empty (a two-column list of names and values)."""
        head = f'<thead><tr>{"".join(f"<th>{esc(h)}</th>" for h in header)}</tr></thead>' if header else ""
        body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
        self.parts.append(f'<table id="{esc(table_id)}">{head}<tbody>{body}</tbody></table>')

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{esc(text)}</p>')

    def collapsible(self, details_id: str, summary: str, text: str) -> None:
        self.parts.append(f'<details id="{esc(details_id)}"><summary>{esc(summary)}</summary>'
                          f"<pre>{esc(text)}</pre></details>")

    def html(self) -> str:
        return f'<section id="{esc(self.id)}"><h2>{esc(self.title)}</h2>\n' + "\n".join(self.parts) + "</section>"


def _cell(value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f'<td class="num">{esc(value)}</td>'
    return f"<td>{esc(value)}</td>"


@dataclass
class Page:
    title: str
    status: str = ""
    sections: list[Section] = field(default_factory=list)

    def section(self, section_id: str, title: str) -> Section:
        section = Section(section_id, title)
        self.sections.append(section)
        return section

    @property
    def figure_ids(self) -> list[str]:
        return [f for s in self.sections for f in s.figure_ids]

    def html(self) -> str:
        nav = " ".join(f'<a href="#{esc(s.id)}">{esc(s.title)}</a>' for s in self.sections)
        body = "\n".join(s.html() for s in self.sections)
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f"<title>{esc(self.title)}</title><style>{STYLE}</style></head>\n<body>"
                f'<h1>{esc(self.title)}</h1><p class="status" id="status">{esc(self.status)}</p>'
                f"<nav>{nav}</nav>\n{body}\n</body></html>\n")
