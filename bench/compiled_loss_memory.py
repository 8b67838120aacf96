"""Memory of the cross-entropy's backward, eager against torch.compile (Inductor), on CPU.

    python bench/compiled_loss_memory.py                    # 4,096 tokens x 32,768 entries
    python bench/compiled_loss_memory.py --tokens 2048 --vocab 16384

Runs the loss OLMo-core and torchtitan take over the head's logits (``logits.float()``,
``F.cross_entropy`` and a z-loss over ``logsumexp``) forward and backward on bf16 logits that
already exist, eager and compiled, each in a fresh process, and prints the resident memory it
adds at its peak in bytes per token and vocabulary entry (the logits' gradient that stays is
2 of them). What Inductor allocates is its graph's buffers, the same on CPU and GPU; the eager
figure is CPU's own (cost/activations.py prices eager CUDA's measured 8 above the saved
4). Imports torch only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _loss(logits, labels):
    import torch.nn.functional as F

    logits = logits.float()
    return F.cross_entropy(logits, labels) + 1e-5 * logits.logsumexp(-1).pow(2).mean()


def measure(mode: str, tokens: int, vocab: int) -> float:
    """Peak resident bytes one forward + backward adds, per token and vocabulary entry."""
    import torch

    torch.manual_seed(0)
    fn = torch.compile(_loss, dynamic=True) if mode == "compiled" else _loss

    def step(t):
        x = torch.randn(t, vocab, dtype=torch.bfloat16, requires_grad=True)
        fn(x, torch.randint(0, vocab, (t,))).backward()

    step(256)
    step(384)  # compiled: both warm-ups compile, the measured call reuses the dynamic graph
    x = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    base = _rss()
    th = threading.Thread(target=sample)
    th.start()
    fn(x, y).backward()
    done.set()
    th.join()
    return (max(peak[0], _rss()) - base) / (tokens * vocab)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--mode", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mode:  # the child: one measurement, printed as JSON
        print(json.dumps({a.mode: measure(a.mode, a.tokens, a.vocab)}))
        return 0
    out = {}
    for mode in ("eager", "compiled"):
        r = subprocess.run([sys.executable, __file__, "--mode", mode, "--tokens", str(a.tokens),
                            "--vocab", str(a.vocab)], capture_output=True, text=True,
                           timeout=900, check=True)
        out.update(json.loads(r.stdout.strip().splitlines()[-1]))
    print(json.dumps({"tokens": a.tokens, "vocab": a.vocab,
                      "bytes_per_token_entry": {k: round(v, 2) for k, v in out.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
