"""`GenerationResult`: what `generate` and the text helpers return.

Rows are prompt-major: row ``r`` is sample ``r % num_samples`` of prompt
``r // num_samples``. Every per-row field is a Python list with one entry per
row; per-token fields hold one entry per generated token of that row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FINISH_REASONS = ("stop", "length", "cache_full", "cancelled", "non_finite")


@dataclasses.dataclass
class Timings:
  """Wall-clock measurements of one request (seconds, tokens per second).

  Attributes:
    compile_s: Time spent tracing and compiling new programs for this request
      (0 when every program came from the cache).
    prefill_s: Time of the prefill call, excluding compilation: the prompt
      written to the cache, and with cached decoding (no captures) every
      row's first token picked and on the host (then equal to
      ``time_to_first_token_s``). On a request that compiles its decode
      program, that program is traced while the prefill runs; the tracing
      counts in ``compile_s`` and not here.
    time_to_first_token_s: From the start of the prefill until the first new
      token of every row was on the host, excluding compilation.
    decode_s: Time spent in the decode loop after the first token (excluding
      compilation and the host work between streamed chunks).
    prepare_s: Host time spent before any program ran: validating the
      request and making the model ready (`Engine.prepare`: unstacking,
      cached mode, flattening); near 0 when the engine had the model, or a
      patched variant of it with the same weights, prepared already. On a
      first request prefilled over the layer stacks, the decode model is
      prepared while the prefill compiles, and counts in ``compile_s``.
    total_s: Wall time of the whole request, preparation and compilation
      included.
    prompt_tokens: Real (unpadded) prompt tokens prefilled (num_samples rows
      of one prompt count once).
    generated_tokens: Tokens generated over all rows (forced ones included).
    prefill_tokens_per_s: ``prompt_tokens / time_to_first_token_s``.
    decode_tokens_per_s: Tokens per second per row after the first token
      (``decode_steps / decode_s``), the usual "decode speed".
    decode_steps: Loop iterations after the first token.
    batch_rows: Rows the compiled loop ran (the batch bucket, padding rows
      included).
  """

  compile_s: float = 0.0
  prefill_s: float = 0.0
  time_to_first_token_s: float = 0.0
  decode_s: float = 0.0
  prepare_s: float = 0.0
  total_s: float = 0.0
  prompt_tokens: int = 0
  generated_tokens: int = 0
  prefill_tokens_per_s: float = 0.0
  decode_tokens_per_s: float = 0.0
  decode_steps: int = 0
  batch_rows: int = 0

  def add_decode_call(self, seconds: float, steps: int) -> None:
    """Accounts one decode call of ``steps`` loop iterations. Where the
    prefill did not pick every row's first token, the first iteration of a
    request does."""
    if steps and not self.time_to_first_token_s:
      first = seconds / steps
      self.time_to_first_token_s = self.prefill_s + first
      seconds, steps = seconds - first, steps - 1
    self.decode_s += seconds
    self.decode_steps += steps


@dataclasses.dataclass
class GenerationResult:
  """Generated tokens (and text, from the text helpers) for every row.

  Attributes:
    tokens: Generated ids per row, without the prompt. A stop token that
      ended the row is included (it is what the model produced); tokens after
      a stop string are removed.
    lengths: ``len(tokens[r])``.
    finish_reasons: Per row: ``"stop"`` (stop token or stop string),
      ``"length"`` (max_new_tokens), ``"cache_full"`` (the KV cache had no
      room left), ``"cancelled"`` or ``"non_finite"`` (the model gave NaN
      or +inf logits, e.g. broken weights or an intervention that
      overflowed: the row ends instead of sampling from them; nothing is
      recorded for that step); None for a row still running (only in a
      streamed result taken before the stream ended).
    logprobs: Per row and token, the log-probability of the chosen token
      under the model's raw distribution (``log_softmax`` of the logits,
      before penalties, bias and filters).
    top_logprobs: With ``logprobs_top_n > 0``, per row and token, the
      ``(token_id, logprob)`` pairs of the most likely tokens (raw
      distribution), most likely first; else None.
    forced: Per row and token, whether the token was forced (given by the
      caller or injected by a tool) rather than sampled.
    prompt_indices: The prompt each row belongs to.
    sample_indices: The sample number of each row within its prompt.
    seeds: The seed each row was sampled with: passing ``seeds[r]`` back as
      ``seed`` with the same prompt and settings (``num_samples=1``)
      reproduces row ``r``.
    prompt_lengths: Length of each row's prompt.
    timings: See `Timings`.
    texts: Decoded text per row (text helpers only, else None): the stop
      token's text and any stop string (with what follows) are removed.
    stop_strings_matched: Text helpers only: the stop string that ended each
      row, or None.
    state: Once finished, the final values of the model's own state
      variables (those of patches, e.g. penzai's ``SaveIntermediate``), by
      label, with the batch axis cut to the result's rows; per-layer
      variables of a layer stack are labelled ``{label}/blocks_{i}``. A
      variable without a value before generation holds what the last decode
      step gave it.
    captures: With ``capture=[names]``, per point name and row, the values
      at that point for every token of the row, prompt then generated
      tokens (``prompt_lengths[r] + lengths[r]`` entries along ``seq``; a
      row ended from the host, by a stop string or cancellation, may lack
      its last token's); else None.
  """

  tokens: list[list[int]]
  finish_reasons: list[str]
  logprobs: list[list[float]]
  forced: list[list[bool]]
  prompt_indices: list[int]
  sample_indices: list[int]
  seeds: list[int]
  prompt_lengths: list[int]
  timings: Timings
  top_logprobs: list[list[list[tuple[int, float]]]] | None = None
  texts: list[str] | None = None
  stop_strings_matched: list[str | None] | None = None
  state: dict[str, Any] | None = None
  captures: dict[str, list[Any]] | None = None

  @property
  def lengths(self) -> list[int]:
    return [len(t) for t in self.tokens]

  @property
  def num_rows(self) -> int:
    return len(self.tokens)

  def __len__(self) -> int:
    return len(self.tokens)

  @property
  def text(self) -> str:
    """The text of the only row (text helpers, one prompt and one sample)."""
    if self.texts is None:
      raise ValueError(
          "this result has no text; use generate_text() (or decode tokens"
          " with a tokenizer).")
    if len(self.texts) != 1:
      raise ValueError(
          f"this result has {len(self.texts)} rows; use .texts[i] instead of"
          " .text.")
    return self.texts[0]

  @classmethod
  def from_outputs(cls, out, lengths: list[int],
                   finish_reasons: list[str | None], request,
                   timings: Timings) -> GenerationResult:
    """A result from a run's host outputs (a `state.Outputs` of numpy
    arrays), the kept length of every row and the request."""
    n = request.num_samples
    rows = range(len(lengths))
    top = None
    if request.logprobs_top_n:
      top = [[list(zip(i, lp)) for i, lp in zip(
          out.top_ids[r, :lengths[r]].tolist(),
          out.top_logprobs[r, :lengths[r]].tolist())] for r in rows]
    tokens = [out.tokens[r, :lengths[r]].tolist() for r in rows]
    timings.generated_tokens = sum(lengths)
    if timings.time_to_first_token_s:
      timings.prefill_tokens_per_s = (
          timings.prompt_tokens / timings.time_to_first_token_s)
    if timings.decode_s and timings.decode_steps:
      timings.decode_tokens_per_s = timings.decode_steps / timings.decode_s
    return cls(
        tokens=tokens,
        finish_reasons=list(finish_reasons),
        logprobs=[out.logprobs[r, :lengths[r]].tolist() for r in rows],
        forced=[out.forced[r, :lengths[r]].tolist() for r in rows],
        prompt_indices=[r // n for r in rows],
        sample_indices=[r % n for r in rows],
        seeds=list(request.seeds),
        prompt_lengths=request.row_prompt_lengths,
        timings=timings,
        top_logprobs=top,
    )

  def rows_of_prompt(self, prompt_index: int) -> list[int]:
    """Row indices of all samples of one prompt."""
    return [r for r, p in enumerate(self.prompt_indices) if p == prompt_index]

  def summary(self) -> str:
    """A one-line human summary of the timings."""
    t = self.timings
    return (
        f"{self.num_rows} rows, {t.generated_tokens} tokens; prefill"
        f" {t.prefill_tokens_per_s:.0f} tok/s, decode"
        f" {t.decode_tokens_per_s:.1f} tok/s/row, ttft"
        f" {t.time_to_first_token_s * 1e3:.0f} ms, compile {t.compile_s:.1f} s")
