"""The single-process reference: the unsharded model, torch.optim.AdamW, the same global batch.

    python -c "from amsp_planner.runtime.reference import reference_run"  # used by the tests

Parity (fp32 mode): the sharded runtime's loss per step and final parameters match this run.
"""

from __future__ import annotations

import torch

from amsp_planner.runtime.data import TokenSource
from amsp_planner.runtime.engine import OptimConfig
from amsp_planner.runtime.model import ReferenceModel
from amsp_planner.runtime.moe import Routing


def reference_run(job, steps: int, seed: int = 0, data: str | None = None,
                  optim: OptimConfig | None = None, gate: str = "balanced"
                  ) -> tuple[list[float], list[torch.Tensor]]:
    """(loss per step, final unpadded fp32 units) of the unsharded fp32 model."""
    optim = optim or OptimConfig()
    routing = Routing(gate, job.training.expert_imbalance)
    model = ReferenceModel(job.model, seed, routing=routing)
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                            eps=optim.eps, weight_decay=optim.weight_decay, foreach=False)
    t = job.training
    source = TokenSource(data, job.model.vocab_size, t.seq_len, t.batch_seqs, seed)
    losses = []
    for step in range(steps):
        batch = source.batch(step)
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.flats]
