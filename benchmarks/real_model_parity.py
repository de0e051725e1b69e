"""Load times and logit differences of the real models against transformers.

For each named model: penzai_lm.load time (fp32), then the max abs logit
difference against Hugging Face transformers loading the same GGUF on CPU,
for each test prompt (plain text, code, chat template; Gemma also 530 and
1,100+ tokens, past its 512-token window).

Run: python benchmarks/real_model_parity.py   (needs the test extra)
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from penzai import pz

import penzai_lm
from penzai_lm.fetch import resolve_model_path

LONG_TEXT = " ".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog number {i * 7}."
    for i in range(60)
)


def main():
  forward = jax.jit(lambda m, t: m(t))
  for name in ("smollm2-135m-instruct", "gemma3-270m"):
    path = resolve_model_path(name)
    start = time.perf_counter()
    model, tokenizer = penzai_lm.load(name)
    load_s = time.perf_counter() - start
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = {
        "plain": tokenizer.encode("The capital of France is"),
        "code": tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n"),
        "chat": tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}]),
    }
    if name == "gemma3-270m":
      ids = tokenizer.encode(LONG_TEXT)
      prompts["530 tokens"] = ids[:530]
      prompts[f"{len(ids)} tokens"] = ids
    print(f"{name}: penzai_lm.load {load_s:.1f}s")
    for label, ids in prompts.items():
      ours = forward(pz.freeze_params(model), pz.nx.wrap(jnp.array(ids)).tag("seq"))
      ours = np.asarray(ours.unwrap("seq", "vocabulary"))
      with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
      diff = np.abs(ours - theirs).max(-1)
      print(
          f"  {label:>12}: max |diff| {diff.max():.2e}, 99th pct over"
          f" positions {np.percentile(diff, 99):.2e}, argmax agreement"
          f" {(ours.argmax(-1) == theirs.argmax(-1)).mean():.3f}"
      )


if __name__ == "__main__":
  main()
