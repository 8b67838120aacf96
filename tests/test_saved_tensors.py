"""Activation memory measured, not assumed: the bytes of every tensor autograd saves for one
micro-batch (``saved_tensors_hooks``, each storage once, parameters excluded) against the eager
profile of ``cost/activations.py``; and the cross-entropy backward's peak, from the profiler's
memory timeline. CPU, one process."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")

from amsp_planner.cost.activations import (  # noqa: E402
    head_bytes_per_token,
    loss_peak_bytes,
    saved_bytes,
)
from amsp_planner.cost.job import Job  # noqa: E402
from amsp_planner.runtime import model as M  # noqa: E402
from amsp_planner.specs import load_cluster, load_model  # noqa: E402
from amsp_planner.specs.model import ModelSpec  # noqa: E402
from amsp_planner.specs.training import TrainingSpec  # noqa: E402

MID = ModelSpec(name="mid-40m", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                ffn_hidden_size=1408, vocab_size=16384, max_seq_len=512)
"""About 40M parameters: GQA, SwiGLU, untied head (the shape of a small LLaMA; a 16K vocabulary
and 128-token sequences keep its bf16 steps a few seconds on CPUs without AVX-512)."""


def _job(spec: ModelSpec, seq: int, mb: int) -> Job:
    t = TrainingSpec(seq_len=seq, global_batch_seqs=mb)
    return Job.create(spec, load_cluster("cpu-local"), t, 1)


class SavedCounter:
    """Counts the bytes of the storages autograd saves (each once), skipping `exclude`. It
    keeps every counted storage alive, so that no later one reuses its address."""

    def __init__(self, exclude):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: dict[int, int] = {}
        self.keep: list = []

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude and st.data_ptr() not in self.seen:
            self.seen[st.data_ptr()] = st.nbytes()
            self.keep.append(st)
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _runtime_saved(spec: ModelSpec, seq: int, mb: int, ckpt: bool) -> int:
    """Peak saved bytes of one micro-batch of the runtime's model (bf16). With checkpointing:
    what forward keeps plus the most one block's recomputation adds in backward."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ref = M.ReferenceModel(spec, 0, torch.bfloat16)
    tok = torch.randint(0, spec.vocab_size, (mb, seq))
    tgt = torch.randint(0, spec.vocab_size, (mb, seq))
    units = [M.views(f, s) for f, s in zip(ref.flats, ref.specs, strict=True)]
    c = SavedCounter(list(ref.parameters()))
    recompute: list[int] = []

    def block(x, p):
        before = c.total
        y = M.block(x, p, spec)
        recompute.append(c.total - before)
        return y

    with torch.autograd.graph.saved_tensors_hooks(c.pack, lambda t: t):
        x = M.embed(tok, units[0])
        for p in units[1:-1]:
            x = checkpoint(block, x, p, use_reentrant=True) if ckpt else M.block(x, p, spec)
        lm = units[0]["tok_emb"] if spec.tied_embeddings else units[-1]["lm_head"]
        loss = M.head_loss(x, units[-1], lm, tgt)
        forward = c.total
        recompute.clear()
        loss.backward()
    return forward + (max(recompute) if ckpt else 0)


@pytest.mark.parametrize("ckpt", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("name,seq,mb", [("tiny", 128, 2), ("mid", 128, 1)])
def test_runtime_saves_the_eager_prediction(name, seq, mb, ckpt):
    spec = load_model("tiny") if name == "tiny" else MID
    measured = _runtime_saved(spec, seq, mb, ckpt)
    predicted = saved_bytes(_job(spec, seq, mb), mb, ckpt)
    assert measured == pytest.approx(predicted, rel=0.02), (measured, predicted)


MOE_SHARED = "tests/data/tiny-moe-shared.yaml"


@pytest.mark.parametrize("ckpt", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("name", ["tiny-moe", MOE_SHARED])
def test_runtime_moe_saves_the_eager_prediction(name, ckpt):
    """Mixture of experts (runtime/moe.py, all experts in one process): the router's fp32
    probabilities, the permuted expert inputs, the experts' SwiGLU tensors and outputs, the
    shared expert, against cost/moe_compute.py's count. The model leaves out the routing's
    own tensors: two int64 slot indices and the k weights per token (about 22 k bytes per
    token of a MoE layer, 1-2 % here)."""
    from pathlib import Path

    spec = load_model(str(Path(__file__).parent / "data" / "tiny-moe-shared.yaml")
                      if name == MOE_SHARED else name)
    measured = _runtime_saved(spec, 128, 2, ckpt)
    predicted = saved_bytes(_job(spec, 128, 2), 2, ckpt)
    assert measured == pytest.approx(predicted, rel=0.025), (measured, predicted)
    assert measured > predicted  # what the model leaves out, never less


def _runtime_saved_checkpointed(spec: ModelSpec, seq: int, mb: int, ckpt, monkeypatch) -> int:
    """Peak saved bytes of one micro-batch of the runtime's model with its own checkpointing
    (``run_block``, non-reentrant): what forward keeps outside the checkpointed blocks
    (``saved_tensors_hooks``), each checkpointed block's input, the matmul and attention
    outputs that op-level checkpointing keeps (counted in the policy), plus the most one
    block's recomputation saves beyond those in backward (``saved_tensors_hooks`` of the
    recomputation, wrapped)."""
    from torch.utils import checkpoint as C
    from torch.utils._pytree import tree_flatten

    torch.manual_seed(0)
    ref = M.ReferenceModel(spec, 0, torch.bfloat16)
    tok = torch.randint(0, spec.vocab_size, (mb, seq))
    tgt = torch.randint(0, spec.vocab_size, (mb, seq))
    units = [M.views(f, s) for f, s in zip(ref.flats, ref.specs, strict=True)]
    params = list(ref.parameters())
    c = SavedCounter(params)
    policy = M.op_policy

    def counting_policy(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if not ctx.is_recompute and decision == C.CheckpointPolicy.MUST_SAVE:
            for t in tree_flatten(ctx.op_output)[0]:
                if isinstance(t, torch.Tensor):
                    c.pack(t)
        return decision

    recompute: list[SavedCounter] = []

    class CountingRecomputation(C._recomputation_hook):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            inner, counter = self.pack_hook, SavedCounter(params)
            counter.exclude |= set(c.seen)  # kept since forward: not new
            recompute.append(counter)
            self.pack_hook = lambda t: inner(counter.pack(t))

    monkeypatch.setattr(M, "op_policy", counting_policy)
    monkeypatch.setattr(C, "_recomputation_hook", CountingRecomputation)
    moe_mlp = M.MOE.moe_mlp

    def counting_moe_mlp(y, *args, **kwargs):  # ckpt=moe: the checkpoint keeps the MLP's input
        c.pack(y)
        return moe_mlp(y, *args, **kwargs)

    monkeypatch.setattr(M.MOE, "moe_mlp", counting_moe_mlp)
    modes = M.block_modes(ckpt, spec.num_layers)
    with torch.autograd.graph.saved_tensors_hooks(c.pack, lambda t: t):
        x = M.embed(tok, units[0])
        for p, mode in zip(units[1:-1], modes, strict=True):
            if mode in ("full", "op"):
                c.pack(x)  # the checkpoint keeps its input for the recomputation
            x = M.run_block(x, p, spec, mode)
        lm = units[0]["tok_emb"] if spec.tied_embeddings else units[-1]["lm_head"]
        loss = M.head_loss(x, units[-1], lm, tgt)
    forward = c.total
    loss.backward()
    # each checkpointed block (ckpt=moe: each MoE layer's MLP) recomputed once
    assert len(recompute) == sum(1 for m, p in zip(modes, units[1:-1], strict=True)
                                 if m and (m != "moe" or "router" in p))
    return forward + max((r.total for r in recompute), default=0)


CKPT_CASES = [("tiny", 128, 2, c) for c in (0, 1, 3, 8, "op")] + [("mid", 128, 1, 3),
                                                                    ("mid", 128, 1, "op")]
"""tiny (2 blocks): none, 1, every block (3 and 8 clip to 2), op; mid (8 blocks): 3 of 8 and
op (its none and every-block counts are the plain and full tests above)."""


@pytest.mark.parametrize("name,seq,mb,ckpt", CKPT_CASES,
                         ids=[f"{n}-ckpt={c}" for n, _, _, c in CKPT_CASES])
def test_runtime_checkpointing_saves_the_prediction(name, seq, mb, ckpt, monkeypatch):
    """k of L blocks and op-level: the runtime's own checkpointing against cost/activations."""
    spec = load_model("tiny") if name == "tiny" else MID
    k = min(ckpt, spec.num_layers) if ckpt != "op" else ckpt
    measured = _runtime_saved_checkpointed(spec, seq, mb, k, monkeypatch)
    predicted = saved_bytes(_job(spec, seq, mb), mb, k)
    assert measured == pytest.approx(predicted, rel=0.02), (measured, predicted)


@pytest.mark.parametrize("name", ["tiny-moe", MOE_SHARED])
def test_runtime_moe_only_checkpointing_saves_the_prediction(name, monkeypatch):
    """ckpt=moe: every block's attention part and the MoE MLPs' inputs kept, one MoE MLP's
    tensors saved again while it is recomputed, against cost/activations.py (the routing's own
    tensors left out, as in the plain MoE test)."""
    from pathlib import Path

    spec = load_model(str(Path(__file__).parent / "data" / "tiny-moe-shared.yaml")
                      if name == MOE_SHARED else name)
    measured = _runtime_saved_checkpointed(spec, 128, 2, "moe", monkeypatch)
    predicted = saved_bytes(_job(spec, 128, 2), 2, "moe")
    assert measured == pytest.approx(predicted, rel=0.025), (measured, predicted)
    assert measured > predicted
    assert predicted < saved_bytes(_job(spec, 128, 2), 2, False)


def test_checkpointing_keeps_the_gradients():
    """Full, partial and op-level checkpointing recompute exactly what forward computed."""
    spec = load_model("tiny")
    torch.manual_seed(0)
    ref = M.ReferenceModel(spec, 0, torch.float32)
    tok = torch.randint(0, spec.vocab_size, (2, 32))
    units = [M.views(f, s) for f, s in zip(ref.flats, ref.specs, strict=True)]

    def grads(ckpt):
        ref.zero_grad()
        x = M.embed(tok, units[0])
        for p, mode in zip(units[1:-1], M.block_modes(ckpt, spec.num_layers), strict=True):
            x = M.run_block(x, p, spec, mode)
        M.head_loss(x, units[-1], units[0]["tok_emb"], tok).backward()
        return [f.grad.clone() for f in ref.flats]

    plain = grads(False)
    for ckpt in (1, True, "op"):
        for a, b in zip(grads(ckpt), plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_mid_model_is_about_40m_parameters():
    assert 35e6 < MID.num_params < 45e6


def test_hugging_face_llama_saves_within_ten_percent_of_eager():
    tr = pytest.importorskip("transformers")
    h, f, a, kvh, v, layers, seq, mb = 256, 896, 8, 2, 8192, 4, 128, 2
    cfg = tr.LlamaConfig(hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                         num_attention_heads=a, num_key_value_heads=kvh, vocab_size=v,
                         max_position_embeddings=512, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    tok = torch.randint(0, v, (mb, seq))
    c = SavedCounter(list(model.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(c.pack, lambda t: t):
        model(input_ids=tok, labels=tok)
    spec = ModelSpec(name="hf-small", num_layers=layers, hidden_size=h, num_heads=a,
                     num_kv_heads=kvh, ffn_hidden_size=f, vocab_size=v, max_seq_len=512)
    predicted = saved_bytes(_job(spec, seq, mb), mb, False)
    assert c.total == pytest.approx(predicted, rel=0.10), (c.total, predicted)


def _peak_bytes(fn) -> float:
    """Peak of the CPU memory timeline (all categories) while `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    with warnings.catch_warnings(), __import__("tempfile").TemporaryDirectory() as d:
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(f"{d}/t.json", device="cpu")
        _, sizes = json.loads(open(f"{d}/t.json").read())
    return max(sum(s) for s in sizes)


def test_cross_entropy_backward_peak_is_twelve_bytes_per_logit():
    """The head's logits in fp32, their log-softmax saved, and backward's two fp32 gradients:
    peak bytes grow by 4V (saved) + 8V (loss peak) per token; measured as the slope between
    two token counts (weights, their gradients and the h-sized tensors are small here)."""
    h, v = 16, 16384
    w = torch.randn(v, h, dtype=torch.bfloat16, requires_grad=True)

    def step(tokens):
        x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
        tgt = torch.randint(0, v, (tokens,))
        return lambda: M.head_loss(x, {"norm": torch.ones(h, dtype=torch.bfloat16)}, w,
                                   tgt).backward()

    t1, t2 = 256, 768
    slope = (_peak_bytes(step(t2)) - _peak_bytes(step(t1))) / (t2 - t1)
    spec = ModelSpec(name="head", num_layers=1, hidden_size=h, num_heads=1,
                     ffn_hidden_size=h, vocab_size=v, max_seq_len=512)
    job = _job(spec, 1, 1)
    logits = 4 * v + loss_peak_bytes(job, 1)  # 12 V
    assert logits == 12 * v
    assert slope == pytest.approx(logits, rel=0.03)
    assert head_bytes_per_token(job) > 4 * v  # the saved log-probabilities are counted
