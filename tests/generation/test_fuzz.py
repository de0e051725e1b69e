"""Property tests (hypothesis) over the argument space of `generate`,
`stream` and `Session.generate`.

1. Any input either works or raises ``ValueError`` / ``TypeError`` whose
   message is non-empty and names the argument, raised by penzai_lm's own
   validation (the last traceback frame is in ``penzai_lm/``, never inside
   JAX or numpy), before anything compiles.
2. Valid greedy requests: cached == ``use_cache=False``; a prompt alone ==
   the same prompt in a batch; sampling: same seed => same output, and every
   ``num_samples`` row is reproduced from ``result.seeds``; a `Session`'s
   turns == `generate` on the whole conversation.
3. `stream`: the events' tokens, concatenated per row, == the result's.

Bounded for CI: few examples, ``derandomize=True`` (deterministic),
``deadline=None``, one tiny model and one `Engine` shared by every test so
compiled programs are reused. Valid requests that the fuzzer stumbles on run
only when their compiled shapes are among the few the properties use
(``_runnable``); others are validated (and prepared) but closed unrun.
"""

import functools
import math
import os
import re
import threading
import traceback

import hypothesis
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm.generation import FINISH_REASONS
from penzai_lm.generation import Engine
from penzai_lm.generation import Session
from penzai_lm.generation import generate
from penzai_lm.generation import stream
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.sampling.settings import DEFAULT_TOP_K_CAP
from tests.model.configs import config

VOCAB = 97
# Default max_new_tokens of the fuzzed requests. Valid requests below take
# 2 to 8 new tokens (some row at least 2): with prompts of at most 8 tokens
# (prompt bucket 8), the cache bucket is always 16.
MAX_NEW = 3
PACKAGE_DIR = os.path.dirname(os.path.abspath(penzai_lm.__file__)) + os.sep

_FUZZ = hypothesis.settings(
    deadline=None, derandomize=True, database=None, print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])


def _sizes_masked(message: str) -> str:
  """``message`` with byte sizes ("8.73 GiB") replaced by one token."""
  return re.sub(r"\d+(?:\.\d+)? (?:[KMGTP]i)?B\b", "<size>", message)


def fuzz(max_examples: int) -> hypothesis.settings:
  """The file's settings with ``max_examples`` examples."""
  return hypothesis.settings(_FUZZ, max_examples=max_examples)


@functools.cache
def model():
  return penzai_lm.build_transformer(config("llama_gqa"), seed=11)


@functools.cache
def engine():
  # Prepared models are per shape bucket; keep all the fuzzer visits.
  return Engine(max_programs=64, max_models=32)


# Checks.


def assert_clean_error(error: BaseException, names, compiled_before=None):
  """A ValueError/TypeError from penzai_lm's validation naming one of
  ``names``, raised before anything compiled."""
  tb = "".join(traceback.format_exception(error))
  assert isinstance(error, (ValueError, TypeError)), (
      f"expected ValueError/TypeError, got:\n{tb}")
  message = str(error)
  assert message.strip(), f"empty message:\n{tb}"
  assert any(n in message for n in names), (
      f"the message does not name any of {sorted(names)}:\n{tb}")
  frame = traceback.extract_tb(error.__traceback__)[-1]
  assert os.path.abspath(frame.filename).startswith(PACKAGE_DIR), (
      f"raised outside penzai_lm (in {frame.filename}):\n{tb}")
  if compiled_before is not None:
    assert engine().compilations == compiled_before, (
        f"compiled before failing:\n{tb}")


def call(fn, *args, **kwargs):
  """``(result, None)`` or ``(None, error)``; errors other than
  ValueError/TypeError are returned too (the checks reject them)."""
  try:
    return fn(*args, **kwargs), None
  except Exception as e:  # pylint: disable=broad-except
    return None, e


def check_result(result, request):
  """Invariants of a finished result of a validated request."""
  assert len(result.tokens) == request.num_rows
  for r, tokens in enumerate(result.tokens):
    reason = result.finish_reasons[r]
    assert reason in FINISH_REASONS and reason != "non_finite", reason
    assert 1 <= len(tokens) <= request.max_new_tokens[r]
    assert all(0 <= t < VOCAB for t in tokens)
    assert len(result.logprobs[r]) == len(result.forced[r]) == len(tokens)
    assert all(math.isfinite(x) and x <= 1e-4 for x in result.logprobs[r])
    forced = request.forced_tokens[r]
    n = min(len(forced), len(tokens))
    assert tokens[:n] == list(forced[:n]) and all(result.forced[r][:n])
    banned = np.asarray(request.sampling.banned_tokens[r])
    stops = set(request.stop_tokens[r])
    for i, (t, f) in enumerate(zip(tokens, result.forced[r])):
      if not f:
        assert not banned[t], (r, t)
        if i < len(tokens) - 1:
          assert t not in stops, (r, t)
    if reason == "length":
      assert len(tokens) == request.max_new_tokens[r]
    elif reason == "stop":
      assert tokens[-1] in stops


def stream_tokens(s):
  """Consumes a stream: per row, the events' tokens concatenated (and a
  check that each row's finish reason arrives once, last)."""
  rows = [[] for _ in range(s.run.rows)]
  ended = [None] * s.run.rows
  for event in s:
    assert ended[event.row] is None, "event after the row's last event"
    rows[event.row].extend(event.tokens)
    assert len(event.logprobs) == len(event.forced) == len(event.tokens)
    ended[event.row] = event.finish_reason
  result = s.result
  assert ended == result.finish_reasons
  return rows, result


def _runnable(s) -> bool:
  """Whether a validated stream's request compiles only the shapes the
  properties below use (batch 1/2/4, prompt bucket 8, cache 16, default
  queue/stops/top-k cap, no logprobs, captures or gathered samples)."""
  request = s.run.request
  shape = request.prefill
  return (shape.decode.use_cache and not shape.gather and not shape.continued
          and shape.decode.batch in (1, 2, 4) and shape.prompt_len == 8
          and shape.decode.cache_len == 16 and shape.decode.queue_len == 16
          and shape.decode.stop_width == 8 and shape.decode.top_n == 0
          and not shape.decode.capture
          and request.sampling.top_k_cap == DEFAULT_TOP_K_CAP)


# Strategies: junk, and the plausible values of every option.

SCALAR_JUNK_VALUES = (
    None, True, False, 0, 1, -1, 2, 7, 2**31, 2**32, 2**63, 2**70, -2**70,
    0.0, 0.5, -0.5, 1.5, 1e-300, 1e-45, 1e39, 1e300, math.nan, math.inf,
    -math.inf, "", "a", "1", b"x", 1j, np.int64(2), np.uint64(2**64 - 1),
    np.float32(0.5), np.float64(math.nan), np.bool_(True), np.array(2),
    np.array([[1, 2]]), np.array([1.5]), jnp.array(1), jnp.float32(0.7),
    jnp.array([1, 2]), object(), {}, set(), frozenset([1]), Ellipsis, (),
    range(3), [[]], [None], [1, [2]], [{}, 1],
)
SCALAR_JUNK = st.sampled_from(SCALAR_JUNK_VALUES)
HASHABLE = st.one_of(st.integers(-3, 120), st.sampled_from(
    [2**70, True, None, 1.5, "a", math.nan, np.int64(3), (1,)]))
JUNK = st.one_of(
    SCALAR_JUNK, st.integers(-2**40, 2**40), st.floats(), st.text(max_size=3),
    st.lists(SCALAR_JUNK, max_size=4),
    st.dictionaries(HASHABLE, st.one_of(st.floats(), SCALAR_JUNK),
                    max_size=3))
IDS = st.integers(-2, VOCAB + 2)
ID_LISTS = st.one_of(
    st.lists(IDS, max_size=5),
    st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=3), max_size=5),
    st.lists(st.one_of(IDS, st.lists(IDS, max_size=2)), max_size=3),
    st.lists(IDS, max_size=3).map(np.asarray),
)
FLOATS = st.one_of(st.floats(-1, 3), st.floats(),
                   st.lists(st.floats(0, 2), min_size=1, max_size=5))
POINTS = st.sampled_from([
    "blocks.0.resid_post", "blocks.2.attn.pattern", "embed", "final_norm",
    "blocks.3.resid_post", "blocks.-1.resid_post", "blocks.0.resid_pots",
    "resid_post", "", "blocks.1.mlp.neurons", "blocks.00.mlp_out"])

OPTIONS = {
    "max_new_tokens": st.one_of(
        st.integers(-1, 12), st.lists(st.integers(-1, 9), max_size=5),
        st.sampled_from([10**4, 2**70])),
    "num_samples": st.one_of(st.integers(-1, 3), st.sampled_from(
        [2**20, 2**31, 2**70, np.int64(2)])),
    "seed": st.one_of(st.integers(-2, 2**33), st.none(),
                      st.lists(st.one_of(st.none(), st.integers(-1, 2**33)),
                               max_size=5)),
    "stop_tokens": ID_LISTS,
    "forced_tokens": st.one_of(ID_LISTS, st.just(list(range(20)))),
    "banned_tokens": st.one_of(ID_LISTS, st.just(list(range(VOCAB)))),
    "logprobs_top_n": st.integers(-2, VOCAB + 2),
    "use_cache": st.booleans(),
    "capture": st.one_of(POINTS, st.lists(POINTS, max_size=2)),
    "temperature": FLOATS,
    "top_k": st.one_of(st.integers(-2, 400), st.lists(
        st.integers(-1, 300), min_size=1, max_size=4)),
    "top_p": FLOATS,
    "min_p": FLOATS,
    "repetition_penalty": FLOATS,
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "logit_bias": st.one_of(
        st.dictionaries(IDS, st.floats(), max_size=3),
        st.lists(st.one_of(st.none(), st.dictionaries(
            st.integers(0, VOCAB - 1), st.floats(-5, 5), max_size=2)),
                 max_size=4)),
}
OPTIONS = {name: st.one_of(plausible, plausible, JUNK)
           for name, plausible in OPTIONS.items()}

# What an error about an argument may call it.
ALIASES = {
    "prompts": ("prompt", "NamedArray"),
    "model": ("model", "TransformerLM", "parameter"),
    "tokens": ("tokens", "Session", "session"),
}


TOKEN = st.integers(0, VOCAB - 1)


@st.composite
def valid_prompts(draw, max_prompts=4, max_len=8):
  """``(prompts, number of prompts)`` in one of the accepted forms."""
  form = draw(st.sampled_from(["ids", "ragged", "tuple", "numpy 1-D",
                               "jax 1-D", "numpy 2-D", "named seq",
                               "named batch", "numpy rows", "range"]))
  if form in ("ids", "numpy 1-D", "jax 1-D", "named seq", "range"):
    ids = draw(st.lists(TOKEN, min_size=1, max_size=max_len))
    return {"ids": ids, "numpy 1-D": np.asarray(ids, np.int64),
            "jax 1-D": jnp.asarray(ids, jnp.int32),
            "named seq": pz.nx.wrap(jnp.asarray(ids)).tag("seq"),
            "range": range(1, 1 + len(ids))}[form], 1
  n = draw(st.integers(1, max_prompts))
  if form in ("numpy 2-D", "named batch"):
    length = draw(st.integers(1, max_len))
    rows = draw(st.lists(st.lists(TOKEN, min_size=length, max_size=length),
                         min_size=n, max_size=n))
    dtype = draw(st.sampled_from([np.int8, np.int32, np.int64, np.uint16]))
    array = np.asarray(rows, dtype)
    if form == "named batch":
      return pz.nx.wrap(jnp.asarray(array)).tag("batch", "seq"), n
    return array, n
  rows = draw(st.lists(st.lists(TOKEN, min_size=1, max_size=max_len),
                       min_size=n, max_size=n))
  if form == "tuple":
    return tuple(tuple(r) for r in rows), n
  if form == "numpy rows":  # A ragged list of arrays and np integers.
    return [np.asarray(r, np.int32) if i % 2 else [np.int64(t) for t in r]
            for i, r in enumerate(rows)], n
  return rows, n


def _as_form(draw, value):
  """``value`` (a number or a list of them) as a Python, numpy or tuple
  value: every form the options accept."""
  form = draw(st.sampled_from(["python", "python", "numpy", "tuple"]))
  if form == "numpy":
    if isinstance(value, list):
      return np.asarray(value) if value and not isinstance(
          value[0], (list, dict)) else value
    if isinstance(value, float):
      return np.float32(value)
    return np.int64(value) if isinstance(value, int) else value
  if form == "tuple" and isinstance(value, list):
    return tuple(value)
  return value


VALID_VALUES = {
    "max_new_tokens": st.integers(2, 8),
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    "top_k": st.integers(0, 40),
    "top_p": st.floats(0.05, 1.0),
    "min_p": st.floats(0.0, 0.9),
    "repetition_penalty": st.floats(0.2, 5.0),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "logit_bias": st.dictionaries(st.one_of(TOKEN, TOKEN.map(np.int64)),
                                  st.floats(-100, 100), max_size=4),
    "banned_tokens": st.lists(TOKEN, max_size=8),
    "stop_tokens": st.lists(TOKEN, max_size=4),
    "forced_tokens": st.lists(TOKEN, max_size=4),
    "seed": st.one_of(st.none(), st.integers(0, 2**32 - 1)),
}


@st.composite
def valid_requests(draw, max_prompts=4):
  """``(prompts, options)``: a valid request in runnable shapes, each option
  one value or one per prompt, in any accepted form."""
  prompts, n = draw(valid_prompts(max_prompts))
  options = {"max_new_tokens": draw(VALID_VALUES["max_new_tokens"])}
  names = draw(st.lists(st.sampled_from(sorted(VALID_VALUES)), max_size=6,
                        unique=True))
  for name in names:
    if draw(st.booleans()):
      value = [draw(VALID_VALUES[name]) for _ in range(n)]
      if name == "max_new_tokens":  # Some rows stop after one token.
        value[0] = draw(st.integers(1, 8))
      if name == "banned_tokens":
        value = [list(v) for v in value]
    else:
      value = draw(VALID_VALUES[name])
    options[name] = _as_form(draw, value)
  if draw(st.integers(0, 4)) == 0:
    options["use_cache"] = True
    options["num_samples"] = draw(st.sampled_from([1, np.int64(1)]))
    options["logprobs_top_n"] = 0
    options["capture"] = draw(st.sampled_from([None, [], ()]))
  return prompts, options


@functools.cache
def _junk_prompt_values():
  return [
      None, 5, 2.5, "hello", b"ids", [], [[]], [[1, 2], []], [1, 2.5],
      [1, None], [True, False], [1, [2]], [[1], 2], [[1, [2]]],
      [[1, "a"]], [[1, None]], [[[1]]], [[2**70]], [-1], [VOCAB],
      [2**64 - 1], ["a", "b"], {1: 2}, {1, 2}, (i for i in range(2)),
      np.zeros((2, 2, 2), np.int32), np.zeros((2, 0), np.int32),
      np.array(3), np.array([1.5]), np.array([True]), np.array([1, 2], object),
      np.array([2**40]), jnp.array([[1.0, 2.0]]),
      pz.nx.wrap(jnp.array([[1, 2]])),
      pz.nx.wrap(jnp.array([[1, 2]])).tag("batch", "tokens"),
      pz.nx.wrap(jnp.array([[1.0, 2.0]])).tag("batch", "seq"),
      pz.nx.wrap(jnp.ones((1, 1, 2), jnp.int32)).tag("a", "b", "seq"),
      pz.nx.wrap(jnp.zeros((1, 0), jnp.int32)).tag("batch", "seq"),
      pz.nx.wrap(jnp.array([[1, VOCAB]])).tag("batch", "seq"),
  ]


JUNK_PROMPTS = st.one_of(
    st.integers(0, 10**6).map(
        lambda i: _junk_prompt_values()[i % len(_junk_prompt_values())]),
    st.lists(st.lists(IDS, max_size=3), max_size=3),
    JUNK)


@functools.cache
def junk_model(name):
  """The model (or junk in its place) called ``name``."""
  if name == "used cached model":
    used = KVCachingTransformerLM.from_uncached(model(), 16, {"batch": 4})
    used.cache_end_index.value = jnp.asarray(3, jnp.int32)
    return used
  return {
      "model": model,
      "None": lambda: None,
      "str": lambda: "llama",
      "object": object,
      "config": lambda: config("llama_gqa"),
      "cached model, 1 row, 4 slots": lambda: (
          KVCachingTransformerLM.from_uncached(model(), 4, {"batch": 1})),
      "cached model, axis rows": lambda: (
          KVCachingTransformerLM.from_uncached(model(), 16, {"rows": 4})),
      "unbound parameters": lambda: penzai_lm.build_transformer(
          config("llama_gqa"), seed=None),
  }[name]()


# Names of models: readable in hypothesis' reports of failing examples.
JUNK_MODELS = ("None", "str", "object", "config", "used cached model",
               "cached model, 1 row, 4 slots", "cached model, axis rows",
               "unbound parameters")
MODELS = st.one_of(*[st.just("model")] * 6, st.sampled_from(JUNK_MODELS))


@st.composite
def junk_requests(draw):
  """(model, prompts, options, stream kwargs, names that may be blamed)."""
  if draw(st.integers(0, 2)) == 0:  # A valid request, all in one bucket.
    prompts, options = draw(valid_requests())
    return "model", prompts, options, {}, set()
  m = draw(MODELS)
  fuzzed = set() if m == "model" else {"model"}
  if draw(st.integers(0, 3)) == 0:
    prompts = draw(JUNK_PROMPTS)
    fuzzed.add("prompts")
  else:
    prompts, _ = draw(valid_prompts())
  names = draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=3,
                        unique=True))
  options = {"max_new_tokens": MAX_NEW}
  for name in names:
    options[name] = draw(OPTIONS[name])
    fuzzed.add(name)
  if draw(st.integers(0, 9)) == 0:  # A misspelt option.
    options[draw(st.sampled_from(["temprature", "top-k", "seeds", "tokens",
                                  "stop_strings"]))] = 1
    fuzzed.add("option")
  extra = {}
  if draw(st.integers(0, 5)) == 0:
    extra["chunk_size"] = draw(st.one_of(
        st.integers(-1, 9), st.sampled_from([1.5, "8", None, True, 2**20])))
    fuzzed.add("chunk_size")
  if draw(st.integers(0, 7)) == 0:
    extra["cancel"] = draw(st.sampled_from(
        [5, "x", True, object(), threading.Event()]))
    fuzzed.add("cancel")
  return m, prompts, options, extra, fuzzed


# Property 1: any input works or fails cleanly.


def check_request(m, prompts, options, extra, fuzzed) -> str:
  """Property 1 for one request through `stream` (and `generate`); returns
  what happened ("rejected", "ran" or "valid, not run")."""
  names = set()
  for name in fuzzed:
    names.update(ALIASES.get(name, (name,)))
  compiled = engine().compilations
  s, error = call(stream, m, prompts, engine=engine(), **options, **extra)
  if error is not None:
    assert_clean_error(error, names, compiled)
    if not {"chunk_size", "cancel"} & fuzzed:
      # generate() validates the same way, with the same message.
      _, error2 = call(generate, m, prompts, engine=engine(), **options)
      assert error2 is not None and type(error2) is type(error)
      # The same text; a memory error names the free memory, measured anew
      # by each call (8.73 GiB, then 8.76 GiB: a red CI run).
      assert _sizes_masked(str(error2)) == _sizes_masked(str(error))
    return "rejected"
  with s:
    if not _runnable(s) or m is not model():
      return "valid, not run"  # It would compile shapes used nowhere else.
    rows, result = stream_tokens(s)
  request = s.run.request
  check_result(result, request)
  assert rows == result.tokens
  # generate() with the streamed rows' seeds gives the same tokens.
  options = dict(options, seed=list(result.seeds))
  again = generate(m, prompts, engine=engine(), **options)
  assert again.tokens == result.tokens
  assert again.finish_reasons == result.finish_reasons
  return "ran"


@fuzz(200)
@given(junk_requests())
def test_generate_and_stream_accept_or_reject_cleanly(request_args):
  model_name, prompts, options, extra, fuzzed = request_args
  outcome = check_request(junk_model(model_name), prompts, options, extra,
                          fuzzed)
  hypothesis.event(outcome)


BASE_PROMPTS = [[1, 2, 3], [4, 5]]


def test_every_option_with_every_junk_value():
  """Not random: the prompts, every option and the model set to each junk
  value in turn (hypothesis draws only a few of them per option)."""
  outcomes = {}
  probes = [("prompts", p, {}) for p in _junk_prompt_values()]
  probes += [("prompts", p, {}) for p in SCALAR_JUNK_VALUES
             if not isinstance(p, (list, tuple))]
  for name in sorted(OPTIONS):
    probes += [(name, BASE_PROMPTS, {name: v}) for v in SCALAR_JUNK_VALUES]
  for name, prompts, options in probes:
    fuzzed = {name}
    try:
      outcome = check_request(model(), prompts,
                              {"max_new_tokens": MAX_NEW, **options}, {},
                              fuzzed)
    except AssertionError as e:
      raise AssertionError(f"{name}={options.get(name, prompts)!r}") from e
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
  for model_name in JUNK_MODELS:
    outcome = check_request(junk_model(model_name), BASE_PROMPTS,
                            {"max_new_tokens": MAX_NEW}, {}, {"model"})
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
  print(f"{sum(outcomes.values())} probes: {outcomes}")


SESSION_TOKENS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    st.lists(st.integers(0, VOCAB - 1), max_size=4).map(np.asarray),
    st.lists(IDS, max_size=4), JUNK,
    # NamedArrays: a known gap (test_known_validation_gaps).
    JUNK_PROMPTS.filter(lambda t: not isinstance(t, pz.nx.NamedArrayBase)))


@fuzz(60)
@given(SESSION_TOKENS, st.lists(st.sampled_from(sorted(OPTIONS)),
                                max_size=2, unique=True), st.data())
def test_session_accepts_or_rejects_cleanly(tokens, names, data):
  if data.draw(st.integers(0, 2), label="valid") == 0:
    tokens, options = data.draw(valid_requests(max_prompts=1), label="valid")
    if isinstance(tokens, pz.nx.NamedArrayBase):  # A known gap (below).
      tokens = tokens.data_array
    if not isinstance(tokens, range):
      tokens = np.asarray(tokens).reshape(-1)  # One prompt, any form.
    options.pop("num_samples", None)  # Sessions take neither.
    options.pop("use_cache", None)
    hypothesis.event(check_session_call(tokens, options, set()))
    return
  options = {"max_new_tokens": MAX_NEW, "temperature": 0.0}
  for name in names:
    options[name] = data.draw(OPTIONS[name], label=name)
  if data.draw(st.integers(0, 4), label="misspelt") == 0:
    options["num_samples" if "num_samples" not in options else "tmp"] = 2
  blame = {*names, "num_samples", "tmp"}
  if not _session_ids(tokens):
    blame.add("tokens")
  hypothesis.event(check_session_call(tokens, options, blame))


def _session_ids(tokens) -> bool:
  """Whether ``tokens`` are valid ids for a fresh `Session` (a non-empty
  flat list or 1-D array of ints in the vocabulary)."""
  if isinstance(tokens, np.ndarray):
    return (tokens.ndim == 1 and tokens.size > 0
            and np.issubdtype(tokens.dtype, np.integer)
            and 0 <= tokens.min() and tokens.max() < VOCAB)
  return (isinstance(tokens, list) and bool(tokens) and all(
      isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB
      for t in tokens))


def check_session_call(tokens, options, fuzzed) -> str:
  """Property 1 for a first `Session` call."""
  allowed = set()
  for name in fuzzed:
    allowed.update(ALIASES.get(name, (name,)))
  session = Session(model(), min_cache_len=32, engine=engine())
  compiled = engine().compilations
  s, error = call(session.stream, tokens, **options)
  if error is not None:
    assert_clean_error(error, allowed, compiled)
    return "rejected"
  with s:
    request = s.run.request
    shape = request.prefill
    if not (shape.prompt_len == 8 and shape.decode.cache_len == 32
            and shape.decode.queue_len == 16 and shape.decode.stop_width == 8
            and shape.decode.top_n == 0 and not shape.decode.capture
            and request.sampling.top_k_cap == DEFAULT_TOP_K_CAP):
      return "valid, not run"
    rows, result = stream_tokens(s)
  check_result(result, request)
  assert rows == result.tokens
  assert session.tokens == request.prompts[0].tolist() + result.tokens[0]
  return "ran"


def test_session_with_every_junk_value():
  """Not random: a first `Session` call with its tokens, then each option,
  set to each junk value in turn."""
  outcomes = {}
  probes = [({"tokens": t}, "tokens") for t in (
      *_junk_prompt_values(), *SCALAR_JUNK_VALUES)
            if not isinstance(t, pz.nx.NamedArrayBase)]
  probes += [({"tokens": [1, 2], name: v}, name) for name in sorted(OPTIONS)
             for v in SCALAR_JUNK_VALUES]
  for options, name in probes:
    options = {"max_new_tokens": MAX_NEW, **options}
    tokens = options.pop("tokens")
    try:
      outcome = check_session_call(tokens, options, {name})
    except AssertionError as e:
      raise AssertionError(f"{name}={options.get(name, tokens)!r}") from e
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
  print(f"{sum(outcomes.values())} probes: {outcomes}")


# Gaps the fuzzer found in engine.py, run.py, stream.py and session.py
# (each was an AttributeError / OverflowError / penzai error from inside);
# kept as regression tests.


def _gap_generate_cancel():
  generate(model(), [1, 2], engine=engine(), max_new_tokens=2, cancel=5)


def _gap_generate_engine():
  generate(model(), [1, 2], max_new_tokens=2, engine="cpu")


def _gap_stream_engine():
  stream(model(), [1, 2], max_new_tokens=2, engine="cpu")


def _gap_session_engine():
  Session(model(), engine="cpu").generate([1, 2], max_new_tokens=2)


def _gap_stream_huge_chunk_size():
  list(stream(model(), [1, 2], engine=engine(), max_new_tokens=2,
              chunk_size=2**70))


def _gap_session_two_row_named_array():
  Session(model(), engine=engine()).generate(
      pz.nx.wrap(jnp.array([[1, 2], [3, 4]])).tag("batch", "seq"),
      max_new_tokens=2)


def _gap_session_dict_tokens():
  Session(model(), engine=engine()).generate({1: 0, 2: 0}, max_new_tokens=2)


def _session_huge_min_cache_len():
  Session(model(), min_cache_len=2**70, engine=engine()).generate(
      [1, 2], max_new_tokens=2)


@pytest.mark.parametrize("probe,name", [
    (_gap_generate_cancel, "cancel"),
    (_gap_generate_engine, "engine"),
    (_gap_stream_engine, "engine"),
    (_gap_session_engine, "engine"),
    (_gap_stream_huge_chunk_size, "chunk_size"),
    (_gap_session_two_row_named_array, "one row"),
    (_gap_session_dict_tokens, "tokens"),
    (_session_huge_min_cache_len, "min_cache_len"),
])
def test_known_validation_gaps(probe, name):
  _, error = call(probe)
  assert error is not None, f"{name} junk was accepted"
  assert_clean_error(error, {name})


def test_a_session_takes_a_one_row_named_array():
  tokens = pz.nx.wrap(jnp.array([[1, 2]])).tag("batch", "seq")
  first = Session(model(), engine=engine()).generate(
      tokens, max_new_tokens=2, temperature=0.0)
  second = Session(model(), engine=engine()).generate(
      [1, 2], max_new_tokens=2, temperature=0.0)
  assert first.tokens == second.tokens


# Property 2: equivalences of valid requests.

PROMPT = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)


@st.composite
def greedy_options(draw, num_prompts):
  """``(options, listed)``: valid greedy options, those named in ``listed``
  given as a list with one value per prompt, the others shared."""
  values = {
      "max_new_tokens": st.integers(2, 6),
      "stop_tokens": st.lists(st.integers(0, VOCAB - 1), max_size=3),
      "forced_tokens": st.lists(st.integers(0, VOCAB - 1), max_size=3),
      "banned_tokens": st.lists(st.integers(0, VOCAB - 1), max_size=5),
      "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1),
                                    st.floats(-3, 3), max_size=3),
      "repetition_penalty": st.floats(0.5, 2.0),
      "presence_penalty": st.floats(-1.0, 1.0),
      "frequency_penalty": st.floats(-1.0, 1.0),
  }
  names = ["max_new_tokens", *draw(st.lists(st.sampled_from(
      sorted(set(values) - {"max_new_tokens"})), max_size=3, unique=True))]
  options, listed = {"temperature": 0.0}, set()
  for name in names:
    if draw(st.booleans()):
      listed.add(name)
      options[name] = draw(st.lists(values[name], min_size=num_prompts,
                                    max_size=num_prompts))
      if name == "max_new_tokens":  # Some rows stop after one token.
        options[name][0] = draw(st.integers(1, 6))
    else:
      options[name] = draw(values[name])
  return options, listed


def prompt_options(options, names, i):
  """The options of prompt ``i`` alone."""
  return {k: (v[i] if k in names else v) for k, v in options.items()}


@fuzz(20)
@given(st.lists(PROMPT, min_size=2, max_size=2), st.data())
def test_cached_matches_uncached_greedy(prompts, data):
  options, _ = data.draw(greedy_options(2))
  cached = generate(model(), prompts, engine=engine(), **options)
  uncached = generate(model(), prompts, engine=engine(), use_cache=False,
                      **options)
  assert cached.tokens == uncached.tokens
  assert cached.finish_reasons == uncached.finish_reasons
  np.testing.assert_allclose(sum(cached.logprobs, []),
                             sum(uncached.logprobs, []), atol=2e-4)


@fuzz(25)
@given(PROMPT, st.sampled_from([1, 2]).flatmap(
    lambda n: st.lists(PROMPT, min_size=n, max_size=n)), st.data())
def test_batch_invariance_greedy(prompt, others, data):
  at = data.draw(st.integers(0, len(others)), label="position")
  batch = others[:at] + [prompt] + others[at:]
  options, per_prompt = data.draw(greedy_options(len(batch)),
                                  label="options")
  together = generate(model(), batch, engine=engine(), **options)
  alone = generate(model(), [prompt], engine=engine(),
                   **prompt_options(options, per_prompt, at))
  assert together.tokens[at] == alone.tokens[0]
  assert together.finish_reasons[at] == alone.finish_reasons[0]


@st.composite
def sampling_options(draw):
  options = {"temperature": draw(st.floats(0.3, 1.5)),
             "max_new_tokens": draw(st.integers(2, 6))}
  optional = {
      "top_k": st.integers(0, 20), "top_p": st.floats(0.2, 1.0),
      "min_p": st.floats(0.0, 0.5), "repetition_penalty": st.floats(0.5, 2),
      "presence_penalty": st.floats(-1, 1), "frequency_penalty":
      st.floats(-1, 1),
      "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1),
                                    st.floats(-3, 3), max_size=3),
      "banned_tokens": st.lists(st.integers(0, VOCAB - 1), max_size=5),
  }
  for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4,
                            unique=True)):
    options[name] = draw(optional[name])
  return options


@fuzz(25)
@given(st.lists(PROMPT, min_size=1, max_size=2), sampling_options(),
       st.one_of(st.none(), st.integers(0, 2**32 - 1)),
       st.integers(1, 8))
def test_same_seed_same_output_and_stream_matches(prompts, options, seed,
                                                  chunk_size):
  first = generate(model(), prompts, engine=engine(), seed=seed, **options)
  if seed is not None:
    assert first.seeds == [seed] * len(prompts)
  seeds = list(first.seeds)
  second = generate(model(), prompts, engine=engine(), seed=seeds, **options)
  assert second.tokens == first.tokens
  assert second.logprobs == first.logprobs
  # Property 3: the stream's events add up to the result.
  s = stream(model(), prompts, engine=engine(), seed=seeds,
             chunk_size=chunk_size, **options)
  rows, result = stream_tokens(s)
  assert rows == result.tokens == first.tokens
  assert result.finish_reasons == first.finish_reasons


@fuzz(12)
@given(PROMPT, sampling_options(),
       st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_num_samples_rows_reproduce_from_seeds(prompt, options, seed):
  result = generate(model(), prompt, engine=engine(), num_samples=2,
                    seed=seed, **options)
  assert result.prompt_indices == [0, 0]
  assert result.sample_indices == [0, 1]
  assert len(set(result.seeds)) == 2
  if seed is not None:
    assert result.seeds[0] == seed
  for r in range(2):
    alone = generate(model(), prompt, engine=engine(), seed=result.seeds[r],
                     **options)
    assert alone.tokens[0] == result.tokens[r], r


@fuzz(12)
@given(st.lists(PROMPT.map(lambda p: p[:4]), min_size=2, max_size=3),
       st.lists(st.integers(2, 4), min_size=3, max_size=3), st.integers(1, 8))
def test_session_turns_match_generate(turns, max_new, chunk_size):
  session = Session(model(), min_cache_len=32, engine=engine())
  conversation = []
  for turn, n in zip(turns, max_new):
    if len(conversation) + len(turn) > 16:  # generate(): prompt bucket 16.
      break
    s = session.stream(turn, max_new_tokens=n, temperature=0.0,
                       chunk_size=chunk_size)
    rows, result = stream_tokens(s)
    assert rows == result.tokens
    conversation += turn
    expected = generate(model(), conversation, engine=engine(),
                        max_new_tokens=n, temperature=0.0)
    assert result.tokens == expected.tokens, len(conversation)
    conversation += result.tokens[0]
    assert session.tokens == conversation


# Regressions of what the fuzzer found (each was accepted or crashed).


@pytest.mark.parametrize("options,match", [
    # float32 overflow: inf settings gave NaN logits and token 0 forever.
    (dict(frequency_penalty=1e39), r"frequency_penalty\[0\] must be finite"
     " as float32"),
    (dict(presence_penalty=-1e39), "presence_penalty"),
    (dict(temperature=1e39), "temperature"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(logit_bias={1: 1e39}), r"logit_bias\[0\]\[1\] must be finite as"),
    (dict(logit_bias={1: 2**1100}), r"logit_bias\[0\]\[1\] must be finite"),
    # float32 underflow to 0 breaks the requirement like 0 does.
    (dict(repetition_penalty=1e-300), r"repetition_penalty\[0\] = 1e-300 is"
     " invalid"),
    (dict(top_p=1e-300), r"top_p\[0\] = 1e-300 is invalid"),
    # int32 overflow (OverflowError from numpy).
    (dict(top_k=2**31), r"top_k\[0\] = 2147483648 is invalid"),
    (dict(top_k=[1, -2**70]), r"top_k\[1\]"),
    # MemoryError / OverflowError while expanding rows (2**31 and up are
    # now refused by the memory check; 2**17 rows fit this tiny model).
    (dict(num_samples=2**16), "num_samples=65536 with 2 prompt"),
    # Point names: the message now names the argument.
    (dict(capture="blocks.0.resid_pots"), "capture: unknown point"),
])
def test_fuzzer_findings_are_rejected(options, match):
  compiled = engine().compilations
  with pytest.raises(ValueError, match=match):
    generate(model(), BASE_PROMPTS, engine=engine(), max_new_tokens=2,
             **options)
  assert engine().compilations == compiled


@pytest.mark.parametrize("prompts,match", [
    ([[1, [2]]], r"prompt 0 must be a flat list of token ids, got \[1, \[2\]"),
    ([[1, 2], [3, [4, 5]]], "prompt 1 must be a flat list"),
    ([True, False], r"such as True; token ids are ints"),
    ([1, [2]], r"mixes ids and other values \(such as \[2\]"),
])
def test_fuzzer_prompt_findings(prompts, match):
  with pytest.raises(ValueError, match=match):
    generate(model(), prompts, engine=engine(), max_new_tokens=2)


def test_per_row_none_logit_bias_means_no_bias():
  with_none = generate(model(), BASE_PROMPTS, engine=engine(),
                       max_new_tokens=3, temperature=0.0,
                       logit_bias=[None, {5: 50.0}])
  plain = generate(model(), BASE_PROMPTS[:1], engine=engine(),
                   max_new_tokens=3, temperature=0.0)
  assert with_none.tokens[0] == plain.tokens[0]
  assert with_none.tokens[1] == [5, 5, 5]
