"""Single-process checks of the runtime's pieces: shard layout, quantization, the counting
wrapper's independence from the cost model, and the model's parameter count."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from amsp_planner.cost.schedule import quantized_bytes  # noqa: E402
from amsp_planner.runtime.collectives import ring_bytes  # noqa: E402
from amsp_planner.runtime.layout import UnitLayout  # noqa: E402
from amsp_planner.runtime.quant import (  # noqa: E402
    dequantize_chunks,
    qbytes,
    quantize_chunks,
)
from amsp_planner.topology import GroupLayout, split_bytes  # noqa: E402

from .mp import env  # noqa: E402


@pytest.mark.parametrize("factors", [(1, 1, 8), (1, 2, 8), (2, 4, 8), (2, 2, 8), (4, 8, 8),
                                     (1, 8, 8), (8, 8, 8), (2, 8, 8)])
def test_os_shard_lies_in_g_shard_in_p_shard(factors):
    s_p, s_g, s_os = factors
    lay = UnitLayout(8 * 64, s_p, s_g, s_os)
    covered = sorted(lay.os_off(o) for o in range(s_os))
    assert covered == [k * lay.os_len for k in range(s_os)]  # a partition of the unit
    for rank in range(8):
        p0, g0, o0 = lay.p_off(rank % s_p), lay.g_off(rank % s_g), lay.os_off(rank % s_os)
        assert p0 <= g0 and g0 + lay.g_len <= p0 + lay.p_len
        assert g0 <= o0 and o0 + lay.os_len <= g0 + lay.g_len


def test_permutations_only_where_the_design_says():
    assert UnitLayout(512, 2, 4, 8).grad_source_chunks() is not None  # 1 < s_P < s_G
    assert UnitLayout(512, 1, 4, 8).grad_source_chunks() is None
    assert UnitLayout(512, 4, 4, 8).grad_source_chunks() is None
    assert UnitLayout(512, 1, 2, 8).update_positions(0) is not None  # s_P < s_G < s_OS
    assert UnitLayout(512, 1, 8, 8).update_positions(0) is None
    assert UnitLayout(512, 8, 8, 8).grad_source_chunks(4, 2) is not None  # qgZ two hops


@pytest.mark.parametrize("bits,tol", [(8, 1 / 127), (4, 1 / 7)])
def test_quantization_round_trip(bits, tol):
    x = torch.randn(4 * 256, generator=torch.Generator().manual_seed(0))
    buf = torch.empty(qbytes(x.numel(), bits, 64), dtype=torch.uint8)
    assert buf.numel() == quantized_bytes(x.numel(), bits, 64)
    quantize_chunks(buf, x, 4, bits, 64)
    y = torch.cat(dequantize_chunks(buf, x.numel(), 4, bits, 64))
    err = (x - y).abs().view(-1, 64).amax(1)
    assert (err <= tol * x.abs().view(-1, 64).amax(1) * 0.5 + 1e-6).all()


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
@pytest.mark.parametrize("size,k,g", [(8, 4, 2), (4, 4, 1), (2, 1, 2), (16, 4, 4)])
def test_ring_bytes_follow_the_design_convention(op, size, k, g):
    mine = ring_bytes(op, 1000.0, size, k, g)
    theirs = split_bytes(op, 1000.0, GroupLayout(size, 1, k, g, False))
    assert mine == pytest.approx(theirs)


def test_counting_wrapper_imports_no_cost_model():
    code = ("import sys, amsp_planner.runtime.collectives; "
            "print([m for m in sys.modules if m.startswith('amsp_planner.cost')])")
    r = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_reference_model_counts_match_the_spec():
    from amsp_planner.runtime.model import ReferenceModel
    from amsp_planner.specs.loader import load_model

    spec = load_model("tiny")
    m = ReferenceModel(spec, seed=0)
    assert [p.numel() for p in m.flats] == spec.unit_params()


def test_token_file_and_stdlib_corpus(tmp_path):
    import numpy as np

    from amsp_planner.errors import AmspUserError
    from amsp_planner.runtime.data import TokenSource

    path = tmp_path / "toks.bin"
    np.arange(1000, dtype=np.uint16).__mod__(200).astype(np.uint16).tofile(path)
    src = TokenSource(str(path), 256, 16, 4, seed=1)
    b = src.batch(3)
    assert b.shape == (4, 17) and int(b.max()) < 200
    assert torch.equal(b, TokenSource(str(path), 256, 16, 4, seed=1).batch(3))  # (seed, step)
    assert torch.equal(src.batch(3, slice(2, 4)), b[2:4])
    with pytest.raises(AmspUserError, match="token id 199 .* not below the model's vocab_size 128"):
        TokenSource(str(path), 128, 16, 4)
    text = TokenSource("stdlib", 256, 32, 2).batch(0)
    assert text.shape == (2, 33) and int(text.max()) < 256


def test_cli_module_does_not_import_torch():
    code = "import sys, amsp_planner.cli.train, amsp_planner.runtime; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_unit_leaves_keep_their_own_version_while_the_buffer_is_written():
    """[Note: leaves and the gather buffers] (runtime/engine.py): gloo bumps an asynchronous gather's output
    version on its own thread, so leaves on a gather buffer must not share its counter, yet
    must read its memory."""
    from amsp_planner.runtime.engine import _alias

    buf = torch.zeros(12)
    leaf = _alias(buf[4:10].view(2, 3)).requires_grad_(True)
    v = leaf._version
    buf.add_(1.0)  # what the next unit's prefetch does to the slot
    assert leaf._version == v
    assert leaf.data_ptr() == buf[4:].data_ptr() and torch.equal(leaf.detach(), torch.ones(2, 3))
    y = (leaf * 2).sum()  # autograd through the alias is unaffected by the buffer's writes
    buf.add_(1.0)
    (g,) = torch.autograd.grad(y, [leaf])
    assert torch.equal(g, torch.full((2, 3), 2.0))
