"""Feature dashboards: what makes a feature fire, and what it writes.

``sae.dashboard(model, autoencoder, prompts, features=[...], tokenizer=)``
runs the prompts through the model (compiled `run_with_cache` passes of
``rows`` prompts), encodes the value at the autoencoder's point and keeps,
for each requested feature:

* its top ``k`` activating tokens, each with ``context`` tokens before and
  after and the feature's activation on every one of them;
* how often it fires (activation > 0) and a histogram of its non-zero
  activations;
* the tokens its decoder direction promotes and suppresses most
  (``w_dec[f] @ W_U``, the model's own unembedding; SAELens's dashboards
  on TransformerLens models use a ``W_U`` with the final norm's weight
  folded in, so their lists can differ where that weight is not 1).

`Dashboard` renders in a notebook (``_repr_html_``) and exports one
self-contained HTML file (`Dashboard.save_html`: inline CSS and SVG, no
script, every token HTML-escaped; `penzai_lm.sae.dashboard_html`).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import numpy as np

from penzai_lm.file_access import write_atomic
from penzai_lm.interp.activation_cache import run_with_cache
from penzai_lm.interp.weights import weights
from penzai_lm.sae.autoencoder import FEATURES
from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.dashboard_html import cards_html
from penzai_lm.sae.dashboard_html import page_html
from penzai_lm.sae.evaluation import sae_point


@dataclasses.dataclass(frozen=True)
class Example:
  """One activating token of a feature, in its context.

  Attributes:
    prompt: The prompt's index.
    position: The token's position in the prompt.
    activation: The feature's activation on it.
    tokens: The context's token texts (the token itself at ``center``).
    activations: The feature's activation on each context token.
    center: The token's index in ``tokens``.
  """

  prompt: int
  position: int
  activation: float
  tokens: tuple[str, ...]
  activations: tuple[float, ...]
  center: int


@dataclasses.dataclass(frozen=True)
class FeatureCard:
  """One feature's dashboard (see the module docstring).

  Attributes:
    feature: The feature's index.
    examples: The top activating tokens, highest first.
    frequency: The fraction of tokens on which it fires.
    max_activation: Its largest activation (0 if it never fires).
    histogram: ``(counts, edges)`` of its non-zero activations.
    top_logits: ``(token text, value)`` pairs its direction promotes most.
    bottom_logits: ... and suppresses most.
  """

  feature: int
  examples: tuple[Example, ...]
  frequency: float
  max_activation: float
  histogram: tuple[tuple[int, ...], tuple[float, ...]]
  top_logits: tuple[tuple[str, float], ...]
  bottom_logits: tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class Dashboard:
  """Feature cards of one autoencoder over a set of prompts.

  Attributes:
    point: The point the autoencoder reads.
    tokens: How many tokens the statistics cover.
    cards: One `FeatureCard` per requested feature, in request order.
  """

  point: str
  tokens: int
  cards: tuple[FeatureCard, ...]

  def __getitem__(self, feature: int) -> FeatureCard:
    for card in self.cards:
      if card.feature == feature:
        return card
    raise KeyError(f"feature {feature} is not on this dashboard; features:"
                   f" {[c.feature for c in self.cards]}.")

  def _repr_html_(self) -> str:
    return cards_html(self)

  def html(self) -> str:
    """A whole self-contained HTML page of the dashboard."""
    return page_html(self)

  def save_html(self, path) -> None:
    """Writes `html` to ``path`` (a temporary file renamed into place)."""
    write_atomic(path, self.html().encode())


def _check_features(features, width: int) -> list[int]:
  features = [features] if isinstance(features, numbers.Integral) else (
      list(features))
  if not features or not all(
      isinstance(f, numbers.Integral) and not isinstance(f, bool)
      and 0 <= f < width for f in features):
    raise ValueError(
        f"features must be one or more feature ids in [0, {width}), got"
        f" {features!r}.")
  return [int(f) for f in features]


def _check_int(name: str, value, low: int) -> int:
  if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
      or value < low):
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  return int(value)


def _activations(model, sae, point, prompts, features, rows):
  """Per prompt, ``[len(prompt), len(features)]`` float32 activations."""
  index = jnp.asarray(features)
  out = []
  for start in range(0, len(prompts), rows):
    batch = prompts[start:start + rows]
    cache = run_with_cache(model, batch, names=[point], logits=False)
    acts = sae.encode(cache[point])
    acts = np.asarray(acts.unwrap("batch", "seq", FEATURES)[..., index],
                      np.float32)
    seq = acts.shape[1]
    out += [acts[r, seq - n:] for r, n in enumerate(cache.lengths)]
  return out


def _logit_table(model, sae, features, tokenizer, n):
  """Per feature (top, bottom) ``n`` tokens of ``w_dec[f] @ W_U``."""
  w_dec = sae.w_dec.unwrap(FEATURES, "embedding")[jnp.asarray(features)]
  w_u = weights(model, "unembed.W_U").unwrap("embedding", "vocabulary")
  logits = np.asarray(w_dec.astype(jnp.float32) @ w_u.astype(jnp.float32))
  tables = []
  for row in logits:
    order = np.argsort(row)
    pick = lambda ids: tuple((_token_text(tokenizer, i), float(row[i]))  # pylint: disable=cell-var-from-loop
                             for i in ids)
    tables.append((pick(order[::-1][:n]), pick(order[:n])))
  return tables


def _token_text(tokenizer, token: int) -> str:
  return str(token) if tokenizer is None else tokenizer.decode([int(token)])


def dashboard(model, sae: SparseAutoencoder, prompts, *, features,
              tokenizer=None, point: str | None = None, k: int = 10,
              context: tuple[int, int] = (8, 4), bins: int = 30,
              logits: int = 10, rows: int = 8) -> Dashboard:
  """Feature cards of ``features`` over ``prompts`` (module docstring).

  Args:
    model: The uncached `TransformerLM` the autoencoder reads.
    sae: An SAE (reads ``embedding`` at a point; not a transcoder).
    prompts: Token id lists (ragged), or texts with ``tokenizer``.
    features: A feature id or a list of them.
    tokenizer: Decodes tokens for display (and encodes text prompts);
      without one tokens show as ids.
    point: Where it reads (default: its config's ``hook_point``).
    k: Top activating tokens per feature.
    context: Tokens shown (before, after) each top token.
    bins: Histogram bins.
    logits: Tokens in each of the top and bottom logit tables.
    rows: Prompts per compiled pass.

  Returns:
    A `Dashboard`.

  Raises:
    ValueError: for a transcoder, no point, bad feature ids or sizes, text
      prompts without a tokenizer, or empty prompts.
  """
  point = sae_point(sae, point, "dashboard")
  features = _check_features(features, sae.config.num_features)
  k, bins, logits, rows = (_check_int(n, v, 1) for n, v in (
      ("k", k), ("bins", bins), ("logits", logits), ("rows", rows)))
  if not isinstance(context, (tuple, list)) or len(context) != 2:
    raise ValueError(f"context must be (before, after) token counts, got"
                     f" {context!r}.")
  context = tuple(_check_int("context", c, 0) for c in context)
  prompts = list(prompts) if not isinstance(prompts, str) else [prompts]
  if any(isinstance(p, str) for p in prompts):
    if tokenizer is None:
      raise ValueError("text prompts need tokenizer= (or give token ids).")
    prompts = [tokenizer.encode(p) if isinstance(p, str) else p
               for p in prompts]
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts must be one or more non-empty prompts.")
  acts = _activations(model, sae, point, prompts, features, rows)
  flat = np.concatenate(acts)  # [tokens, features]
  where = [(p, t) for p, a in enumerate(acts) for t in range(len(a))]
  tables = _logit_table(model, sae, features, tokenizer, logits)
  cards = []
  for j, feature in enumerate(features):
    column = flat[:, j]
    top = [i for i in np.argsort(-column, kind="stable")[:k]
           if column[i] > 0]
    examples = []
    for i in top:
      p, t = where[i]
      lo, hi = max(0, t - context[0]), min(len(acts[p]), t + context[1] + 1)
      examples.append(Example(
          prompt=p, position=t, activation=float(column[i]),
          tokens=tuple(_token_text(tokenizer, x) for x in prompts[p][lo:hi]),
          activations=tuple(float(a) for a in acts[p][lo:hi, j]),
          center=t - lo))
    nonzero = column[column > 0]
    counts, edges = np.histogram(nonzero, bins=bins) if nonzero.size else (
        np.zeros(bins, int), np.zeros(bins + 1))
    cards.append(FeatureCard(
        feature=feature, examples=tuple(examples),
        frequency=float((column > 0).mean()),
        max_activation=float(column.max(initial=0.0)),
        histogram=(tuple(int(c) for c in counts),
                   tuple(float(e) for e in edges)),
        top_logits=tables[j][0], bottom_logits=tables[j][1]))
  return Dashboard(point=point, tokens=len(flat), cards=tuple(cards))
