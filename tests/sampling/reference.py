"""NumPy (float64) reference implementations for the sampling tests.

Array conventions: single rows, ``logits`` of shape (vocab,); the returned
distributions are float64 (vocab,) probability vectors.
"""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x, np.float64)
  finite = np.isfinite(x)
  out = np.zeros_like(x)
  z = np.exp(x[finite] - x[finite].max())
  out[finite] = z / z.sum()
  return out


def filtered_probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                   logit_bias=None, banned=()) -> np.ndarray:
  """The distribution ``sample_next`` should draw from, computed directly.

  HF order: bias, bans, temperature, top-k, top-p (on the top-k-renormalised
  distribution; keep a token iff the mass of strictly earlier tokens in the
  stable descending order is < top_p), min-p (p >= min_p * p_max).
  """
  x = np.asarray(logits, np.float64).copy()
  if logit_bias:
    for token, bias in logit_bias.items():
      x[token] += bias
  x[list(banned)] = -np.inf
  if temperature == 0:
    out = np.zeros_like(x)
    out[np.argmax(x)] = 1.0
    return out
  x = x / temperature
  order = np.argsort(-x, kind="stable")  # Ties: lower id first.
  xs = x[order]
  keep = np.isfinite(xs)
  if top_k > 0:
    keep[top_k:] = False
  if top_p < 1:
    p = softmax(np.where(keep, xs, -np.inf))
    before = np.cumsum(p) - p
    keep &= before < top_p
  if min_p > 0:
    keep &= xs >= xs[0] + np.log(min_p)
  keep[0] = True
  out = np.zeros_like(x)
  out[order] = softmax(np.where(keep, xs, -np.inf))
  return out


def top_p_margin(logits, *, temperature=1.0, top_k=0, top_p=1.0) -> float:
  """Distance of the cumulative masses from ``top_p`` (float32 safety)."""
  x = np.asarray(logits, np.float64) / temperature
  xs = np.sort(x)[::-1]
  if top_k > 0:
    xs = xs[:top_k]
  p = softmax(xs)
  return float(np.min(np.abs(np.cumsum(p) - p - top_p)))


def penalize(logits, counts, seen, repetition, presence, frequency):
  """Row-by-row loops: HF repetition penalty then OpenAI penalties."""
  out = np.array(logits, np.float64)
  batch, vocab = out.shape
  for b in range(batch):
    for v in range(vocab):
      if seen[b, v]:
        if out[b, v] > 0:
          out[b, v] /= repetition[b]
        else:
          out[b, v] *= repetition[b]
      if counts[b, v] > 0:
        out[b, v] -= presence[b]
      out[b, v] -= frequency[b] * counts[b, v]
  return out


def chi_square_bound(df: int, z: float = 4.75) -> float:
  """Upper chi-square quantile (Wilson-Hilferty); z=4.75 is p ~ 1e-6."""
  df = max(df, 1)
  return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
  """(chi-square statistic / its 1e-6 bound, total variation distance).

  Bins with expected count < 5 are merged, as the chi-square approximation
  requires.
  """
  n = counts.sum()
  expected = probs * n
  big = expected >= 5
  obs = list(counts[big]) + [counts[~big].sum()]
  exp = list(expected[big]) + [expected[~big].sum()]
  obs, exp = np.asarray(obs, np.float64), np.asarray(exp)
  nonzero = exp > 0
  stat = np.sum((obs[nonzero] - exp[nonzero]) ** 2 / exp[nonzero])
  ratio = stat / chi_square_bound(int(nonzero.sum()) - 1)
  tv = 0.5 * np.abs(counts / n - probs).sum()
  return float(ratio), float(tv)


def hf_warped_probs(logits, **settings) -> np.ndarray:
  """The distribution HF ``generate(do_sample=True)`` draws from: its own
  logits warpers (temperature, top-k, top-p, min-p, typical, epsilon, eta,
  in HF's order) applied in float64 by ``transformers``."""
  import torch  # pylint: disable=g-import-not-at-top
  from transformers.generation import logits_process as lp  # pylint: disable=g-import-not-at-top
  warpers = {
      "temperature": lambda v: lp.TemperatureLogitsWarper(v),
      "top_k": lambda v: lp.TopKLogitsWarper(v),
      "top_p": lambda v: lp.TopPLogitsWarper(v),
      "min_p": lambda v: lp.MinPLogitsWarper(v),
      "typical_p": lambda v: lp.TypicalLogitsWarper(v),
      "epsilon_cutoff": lambda v: lp.EpsilonLogitsWarper(v),
      "eta_cutoff": lambda v: lp.EtaLogitsWarper(v, device="cpu"),
  }
  unknown = set(settings) - set(warpers)
  assert not unknown, unknown
  scores = torch.tensor(np.asarray(logits, np.float64))[None]
  for name, make in warpers.items():  # HF's order.
    if name in settings:
      scores = make(settings[name])(None, scores)
  return softmax(scores[0].numpy())


def xtc(probs, *, probability, threshold, coin) -> np.ndarray:
  """llama.cpp's XTC (``llama_sampler_xtc``) on a distribution.

  ``probs``: float (vocab,), the distribution the earlier filters left (0 =
  removed). Written from llama.cpp's definition: nothing happens when
  ``probability <= 0``, ``threshold > 0.5``, fewer than two candidates are
  left, or the draw ``coin`` is ``> probability``; otherwise the candidates
  are sorted by probability (ties: lower id first), ``pos_last`` is the
  last position of the leading run with ``p >= threshold``, and the first
  ``pos_last`` candidates are removed (min_keep = 1 always holds).
  """
  probs = np.asarray(probs, np.float64)
  ids = np.flatnonzero(probs > 0)
  if probability <= 0 or threshold > 0.5 or len(ids) < 2:
    return probs
  if coin > probability:
    return probs
  order = ids[np.argsort(-probs[ids], kind="stable")]
  pos_last = 0
  for i, token in enumerate(order):
    if probs[token] >= threshold:
      pos_last = i
    else:
      break
  out = probs.copy()
  if pos_last > 0:
    out[order[:pos_last]] = 0.0
  return out / out.sum()
