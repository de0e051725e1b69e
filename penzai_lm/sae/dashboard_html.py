"""HTML of a feature dashboard (`penzai_lm.sae.dashboard.Dashboard`).

Self-contained: inline CSS, histograms as inline SVG, no script and no
external resource, so the file opens anywhere (a notebook cell, a browser
from disk, an email attachment). Every text that comes from the model's
vocabulary or the prompts is HTML-escaped: a token spelling ``<script>``
shows as text. Each card is a ``<section class="pzlm-feature"
data-feature="N">``; each example a ``<div class="pzlm-example">`` whose
tokens are ``<span>``s shaded by the activation (the top token
``class="pzlm-top"``), with the value in the ``title``.
"""

from __future__ import annotations

import html

_STYLE = """
.pzlm-dashboard { font-family: system-ui, sans-serif; font-size: 13px; }
.pzlm-feature { border: 1px solid #ccc; border-radius: 6px; margin: 8px 0;
  padding: 8px 12px; }
.pzlm-feature h3 { margin: 0 0 4px 0; font-size: 15px; }
.pzlm-stats { color: #555; margin-bottom: 6px; }
.pzlm-columns { display: flex; gap: 16px; flex-wrap: wrap; }
.pzlm-logits td { padding: 0 6px; font-family: monospace; }
.pzlm-example { font-family: monospace; white-space: pre-wrap;
  margin: 2px 0; }
.pzlm-example span { border-radius: 2px; margin-right: 1px; }
.pzlm-top { outline: 1px solid #c60; font-weight: bold; }
.pzlm-value { color: #888; margin-right: 6px; }
"""


def _shade(value: float, top: float) -> str:
  alpha = 0.0 if top <= 0 else max(0.0, min(1.0, value / top))
  return f"background: rgba(255, 140, 0, {alpha:.3f})"


def _token(text: str) -> str:
  """A token's text, escaped, with newlines shown (they would break the
  line of its example)."""
  return html.escape(text.replace("\n", "\\n"), quote=True)


def _example(example, top: float) -> str:
  spans = []
  for i, (text, value) in enumerate(zip(example.tokens,
                                        example.activations)):
    cls = ' class="pzlm-top"' if i == example.center else ""
    spans.append(f'<span{cls} style="{_shade(value, top)}"'
                 f' title="{value:.4g}">{_token(text)}</span>')
  return (f'<div class="pzlm-example"><span class="pzlm-value">'
          f'{example.activation:.3g}</span>{"".join(spans)}</div>')


def _histogram(counts, edges) -> str:
  width, height = 240, 60
  if not counts or max(counts) == 0:
    return '<svg class="pzlm-histogram" width="240" height="60"></svg>'
  bar = width / len(counts)
  tallest = max(counts)
  bars = "".join(
      f'<rect x="{i * bar:.1f}" y="{height - height * c / tallest:.1f}"'
      f' width="{max(bar - 1, 0.5):.1f}" height="{height * c / tallest:.1f}"'
      f' fill="#e08a00"><title>{edges[i]:.3g} to {edges[i + 1]:.3g}: {c}'
      "</title></rect>" for i, c in enumerate(counts))
  return (f'<svg class="pzlm-histogram" width="{width}" height="{height}"'
          f' xmlns="http://www.w3.org/2000/svg">{bars}</svg>')


def _logits(title: str, rows) -> str:
  body = "".join(f"<tr><td>{_token(t)}</td><td>{v:+.3f}</td></tr>"
                 for t, v in rows)
  return (f'<table class="pzlm-logits"><caption>{title}</caption>{body}'
          "</table>")


def card_html(card) -> str:
  """One feature's ``<section>``."""
  examples = "".join(_example(e, card.max_activation) for e in card.examples)
  edges = card.histogram[1]
  lo, hi = (edges[0], edges[-1]) if edges else (0.0, 0.0)
  return (
      f'<section class="pzlm-feature" data-feature="{card.feature}">'
      f"<h3>Feature {card.feature}</h3>"
      f'<div class="pzlm-stats">fires on {card.frequency:.2%} of tokens,'
      f" max {card.max_activation:.3g}</div>"
      f'<div class="pzlm-columns"><div>{_histogram(*card.histogram)}'
      f'<div class="pzlm-stats">activations {lo:.3g} to {hi:.3g}</div></div>'
      f"{_logits('promotes', card.top_logits)}"
      f"{_logits('suppresses', card.bottom_logits)}</div>"
      f'<div class="pzlm-examples">{examples or "never fires"}</div>'
      "</section>")


def cards_html(dashboard) -> str:
  """The dashboard as an HTML fragment (a notebook cell's output)."""
  cards = "".join(card_html(c) for c in dashboard.cards)
  return (f"<style>{_STYLE}</style><div class=\"pzlm-dashboard\">"
          f"<p>{html.escape(dashboard.point)}: {dashboard.tokens} tokens</p>"
          f"{cards}</div>")


def page_html(dashboard) -> str:
  """The dashboard as a whole HTML page."""
  return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
          f"<title>Features at {html.escape(dashboard.point)}</title>"
          f"</head><body>{cards_html(dashboard)}</body></html>\n")
