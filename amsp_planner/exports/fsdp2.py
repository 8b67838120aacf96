"""FSDP2 (``torch.distributed.fsdp.fully_shard``): a plan as a small Python module.

    amsp export plan.json --to fsdp2 -o amsp_fsdp2.py

The generated module holds the settings as constants and ``apply(model, world_mesh=None)``,
which calls ``fully_shard`` on each block, then on the root. What FSDP2 expresses:

- a 2-D device mesh (replicate, shard) = (N/s, s) with s_P = s_G = s_OS = s: FSDP (s = N),
  HSDP and MiCS (s < N) exactly, DDP-like at s = 1;
- ``reshard_after_forward=h`` (an int, 1 < h < s, h | s): after forward the parameters stay
  sharded h-way, so the backward all-gather runs over h GPUs inside the node: the planner's
  hpZ (``hpz=h``). FSDP2 frees that copy after backward; ZeRO++ keeps it, but both hold it
  for every unit at the forward/backward boundary, where memory peaks.

Prefetch: FSDP2's default, implicit, one block ahead in forward and in backward, so two blocks'
unsharded parameters (and in backward two blocks' gradients) are live at a time: the two gather
and two gradient buffers of the largest unit that the memory model counts (cost/memory.py).

Not expressed, so never chosen as "closest": s_P < s_G or s_G < s_OS (FSDP2 shards the three
together), qwZ and qgZ (no quantized collectives). ``reshard_after_forward=False`` (gather once
per micro-batch, keep full parameters until backward ends) is ZeRO-2-like in traffic but holds
unsharded parameters, a point outside the cost model's space: we do not emit it.

Activation checkpointing (``ACTIVATION_CHECKPOINTING``: True, False, K or "op"), applied by
``apply`` before sharding, to the blocks it finds or to those passed as ``blocks=[...]`` (in
forward order): ``checkpoint_wrapper`` on every block, on the first K blocks (the planner's
convention), or on every block with a selective-checkpointing ``context_fn`` that keeps the
outputs of the matmuls and of attention ("op", as the bundled runtime does). Each wrapper
replaces its block in the block's parent module and is that block's FSDP unit. ``apply``
raises ValueError rather than shard without the plan's checkpointing: a block to wrap that is
not a submodule of the model, or a plan's K larger than the model's blocks (``strict``).

Tensor parallelism (a plan with tp = T > 1): the module also holds ``TP_SIZE`` and its
``build_mesh`` makes the (replicate, shard, tp) mesh with TP innermost (a TP group is T
consecutive ranks of one node, the plan's layout); ``apply`` first calls ``parallelize_module``
on the "tp" dimension with the Megatron-style plan torchtitan's Llama uses (QKV and the MLP's
gate/up ``ColwiseParallel``, the output projection and down ``RowwiseParallel`` with sequence-
sharded outputs, the norms ``SequenceParallel``, the attention and MLP inputs gathered by
``PrepareModuleInput``: the first input only, positionally or as Hugging Face's
``hidden_states`` keyword, after the module's forward signature, ``input_layouts``; in a
tensorwise FP8 plan torchao's ``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and
``PrepareFloat8ModuleInput``, whose all-gathers move FP8 as the plan prices them), then ``fully_shard`` on the (replicate, shard) dimensions. Module names
of torchtitan's Llama (wq/wk/wv/wo, w1/w2/w3, attention_norm/ffn_norm) and of Hugging Face's
(q_proj/.../down_proj, input_layernorm/post_attention_layernorm) are recognised; the attention
must reshape with -1 heads (torchtitan's does) so that it runs on its a/T local heads.

Mixture of experts (a plan with ``ep=E`` and expert factor F): the experts get a mesh of their
own, (ereplicate, eshard, ep) over the plan's EP and EDP groups, in either placement
(exports/fsdp2_moe.py).

With gradient accumulation, HSDP's replica all-reduce runs on every micro-batch unless told
otherwise; the plan's schedule all-reduces once per step, so the module provides
``set_micro_batch(model, index)`` to call before each micro-batch's backward.

This module chooses the settings and writes the module's text; ``exports/fsdp2_check.py``
applies a written module with torch on a tiny model (``--check``).
"""

from __future__ import annotations

from amsp_planner.cost.job import Job
from amsp_planner.exports import fsdp2_moe
from amsp_planner.exports.common import ExportResult, expressible, finish
from amsp_planner.exports.fsdp2_check import (  # noqa: F401 - also this module's API
    check_in_child,
    check_with_torch,
    load_module,
)
from amsp_planner.strategy import Strategy

TARGET = "fsdp2"

WHY = {
    "s_P": "FSDP2 shards parameters, gradients and optimizer states over one group",
    "s_G": "FSDP2 shards parameters, gradients and optimizer states over one group",
    "s_OS": "FSDP2 shards parameters, gradients and optimizer states over one group",
    "hpZ": "reshard_after_forward=int needs 1 < h < shard size",
    "qwz": "FSDP2 has no quantized all-gather",
    "qgz": "FSDP2 has no quantized gradient reduction",
    **{f"ep.{c}": "FSDP2 shards the experts' P, G and OS over one group" for c in ("p", "g", "os")},
}


def candidates(job: Job, plan: Strategy) -> list[Strategy]:
    """Every strategy the target runs exactly for this job (its engine profile,
    amsp_planner/engines.py), with the plan's micro-batch, accumulation and checkpointing."""
    return expressible(job.for_engine(TARGET), plan)


def settings(job: Job, s: Strategy) -> dict:
    """The constants of the generated module for strategy `s` (one of ``candidates``)."""
    assert s.s_p == s.s_g == s.s_os and not (s.qwz or s.qgz), f"{s} is not an FSDP2 strategy"
    t = job.training
    n = job.num_gpus
    param = "float32" if t.precision == "fp32" else "bfloat16"
    reduce = "bfloat16" if t.grad_dtype_name == "bf16" else "float32"
    dp = n // s.tp
    return {
        "STRATEGY": str(s),
        "NUM_GPUS": n,
        "GPUS_PER_NODE": job.gpus_per_node,
        **({"TP_SIZE": s.tp} if s.tp > 1 else {}),
        "SHARD_SIZE": s.s_p,
        "REPLICATE_SIZE": dp // s.s_p,
        "MESH_SHAPE": (dp // s.s_p, s.s_p),
        "RESHARD_AFTER_FORWARD": s.hpz if s.hpz > 1 else True,
        "PARAM_DTYPE": param,
        "REDUCE_DTYPE": reduce,
        "MICRO_BATCH": s.micro_batch,
        "GRAD_ACCUM": job.n_micro(s),
        "ACTIVATION_CHECKPOINTING": s.ckpt_value,
        **fsdp2_moe.settings(job, s),
    }


_BODY = '''

def mesh_shape(world_size: int = NUM_GPUS) -> tuple[int, int]:
    """(replicate, shard) for `world_size` ranks: the shard group is SHARD_SIZE consecutive ranks."""
    if world_size % SHARD_SIZE:
        raise ValueError(f"world size {world_size} is not a multiple of SHARD_SIZE {SHARD_SIZE}")
    return (world_size // SHARD_SIZE, SHARD_SIZE)


def build_mesh(device_type: str = "cuda"):
    """The (replicate, shard) device mesh of the plan; call after init_process_group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, MESH_SHAPE, mesh_dim_names=("replicate", "shard"))


def mp_policy():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=getattr(torch, PARAM_DTYPE),
                                reduce_dtype=getattr(torch, REDUCE_DTYPE))


BLOCK_LISTS = ("layers", "h", "blocks")
"""Names of the module list that holds a decoder's blocks: torchtitan and Hugging Face
(`model.layers`, `model.model.layers`), GPT-2 style (`transformer.h`), others (`blocks`)."""


def block_container(model):
    """The ModuleList/ModuleDict of the model's transformer blocks, searched breadth first
    (`model.layers`, then `model.model.layers`, ...); ValueError when there is none."""
    import torch

    for name, mod in sorted(model.named_modules(), key=lambda kv: kv[0].count(".")):
        if (name.rsplit(".", 1)[-1] in BLOCK_LISTS and len(mod) > 0
                and isinstance(mod, torch.nn.ModuleList | torch.nn.ModuleDict)):
            return mod
    raise ValueError(
        f"{type(model).__name__}: no transformer blocks found (a ModuleList or ModuleDict named "
        f"{', '.join(BLOCK_LISTS)}): pass them, apply(model, mesh, blocks=[...]), or the whole "
        "model would be one FSDP unit")


def default_blocks(model):
    """The model's transformer blocks, each its own FSDP unit (see block_container)."""
    layers = block_container(model)
    return list(layers.values()) if hasattr(layers, "values") else list(layers)


def _op_policy(ctx, func, *args, **kwargs):
    """Selective checkpointing: keep the outputs of matmuls and attention, recompute the rest."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    keep = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_count(n_blocks: int, setting=ACTIVATION_CHECKPOINTING, strict: bool = True) -> int:
    """How many blocks, the first ones, the plan checkpoints out of `n_blocks`: all of them
    (True, "op"), none (False), or K. K > n_blocks is a model that is not the plan's: ValueError,
    or with strict=False (a small test model) every block."""
    if setting is True or setting == "op":
        return n_blocks
    if not setting:
        return 0
    k = int(setting)
    if k > n_blocks and strict:
        raise ValueError(f"the plan checkpoints the first {k} blocks (ACTIVATION_CHECKPOINTING) "
                         f"but the model has {n_blocks}: pass all of its blocks, in forward "
                         "order, or pass strict=False")
    return min(k, n_blocks)


def _parents(model) -> dict:
    """id(module) -> (parent, attribute name) for every submodule of `model`."""
    out = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            out.setdefault(id(child), (parent, name))
    return out


def checkpoint_blocks(model, blocks=None, setting=ACTIVATION_CHECKPOINTING, strict: bool = True):
    """Apply the plan's activation checkpointing to the blocks and return them as FSDP units.

    blocks: in forward order; None for the model's own (see block_container). The first
    checkpoint_count(len(blocks)) of them are wrapped with checkpoint_wrapper (non-reentrant
    torch.utils.checkpoint), each wrapper replacing its block in the block's parent module, with
    the selective-checkpointing context_fn for "op". A block already wrapped is kept as it is.
    ValueError (nothing changed) when a block to wrap is not a submodule of `model`: it could not
    be replaced, and its activations would be kept although the plan recomputes them.
    """
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    units = default_blocks(model) if blocks is None else list(blocks)
    kw = {}
    if setting == "op":
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _op_policy)
    for i, parent, name in wrap_targets(model, units, setting, strict):
        units[i] = checkpoint_wrapper(units[i], **kw)
        setattr(parent, name, units[i])
    return units


def wrap_targets(model, units, setting=ACTIVATION_CHECKPOINTING, strict: bool = True) -> list:
    """(index, parent, attribute name) of each block checkpoint_blocks wraps (not those already
    wrapped); ValueError, before anything changes, where the plan's checkpointing cannot be
    applied (see checkpoint_blocks and checkpoint_count)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    parents = _parents(model)
    out = []
    for i, block in enumerate(units[:checkpoint_count(len(units), setting, strict)]):
        if isinstance(block, CheckpointWrapper):
            continue
        if id(block) not in parents:
            raise ValueError(
                f"blocks[{i}] ({type(block).__name__}) is not a submodule of the model, so it "
                f"cannot be wrapped for the plan's activation checkpointing "
                f"(ACTIVATION_CHECKPOINTING={setting!r}): pass the model's own blocks")
        out.append((i, *parents[id(block)]))
    return out


def apply(model, world_mesh=None, *, blocks=None, strict: bool = True):
    """Checkpoint the plan's blocks (checkpoint_blocks), fully_shard each block, then the root,
    with the plan's settings; returns the model.

    world_mesh: a 2-D (replicate, shard) or 1-D (shard) DeviceMesh, or None to build the
    plan's. blocks: the transformer blocks in forward order (default: found, block_container).
    strict=False accepts another mesh (e.g. one process in a test), falls back to
    reshard_after_forward=True when the plan's int does not divide its shard size, and
    checkpoints every block of a model with fewer blocks than the plan's K.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = build_mesh() if world_mesh is None else world_mesh
    shape = tuple(mesh.shape) if mesh.ndim == 2 else (1, mesh.size())
    if strict and shape != MESH_SHAPE:
        raise ValueError(f"mesh {shape} is not the plan's (replicate, shard) {MESH_SHAPE}: "
                         f"launch {NUM_GPUS} ranks or pass strict=False")
    reshard = RESHARD_AFTER_FORWARD
    if not isinstance(reshard, bool) and not (1 < reshard < shape[1] and shape[1] % reshard == 0):
        reshard = True
    units = checkpoint_blocks(model, blocks, strict=strict)
    policy = mp_policy()
    for block in units:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model


def set_micro_batch(model, index: int) -> None:
    """Before micro-batch `index`'s backward: all-reduce across replicas only on the last one.

    Reduce-scatter inside the shard group still runs every micro-batch; this keeps HSDP's
    replica all-reduce to once per step, as the plan's schedule prices it.
    """
    if REPLICATE_SIZE > 1:
        model.set_requires_all_reduce(index == GRAD_ACCUM - 1)
'''

_TP_BODY = '''

# ----- tensor parallelism (TP_SIZE > 1): these replace build_mesh and apply above -----------
COLWISE = ("wq", "wk", "wv", "w1", "w3", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("wo", "w2", "o_proj", "down_proj")
NORMS = ("attention_norm", "ffn_norm", "input_layernorm", "post_attention_layernorm")
INPUTS = ("attention", "feed_forward", "self_attn", "mlp")


def build_mesh(device_type: str = "cuda"):
    """The (replicate, shard, tp) device mesh of the plan, TP innermost (TP_SIZE consecutive
    ranks of a node); call after init_process_group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (*MESH_SHAPE, TP_SIZE),
                            mesh_dim_names=("replicate", "shard", "tp"))


def tp_plan(block) -> dict:
    """parallelize_module's plan for one block, by its submodules' names (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if globals().get("FP8_RECIPE") == "tensorwise":  # the plan's FP8 TP all-gathers (torchao)
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as ColwiseParallel,
            Float8RowwiseParallel as RowwiseParallel,
            PrepareFloat8ModuleInput as PrepareModuleInput,
        )
    plan = {}
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLWISE:
            plan[name] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[name] = RowwiseParallel(output_layouts=Shard(1))
        elif leaf in NORMS:
            plan[name] = SequenceParallel()
        elif leaf in INPUTS and name.count(".") == 0:
            plan[name] = PrepareModuleInput(**input_layouts(module, Shard(1), Replicate()))
    return plan


def input_layouts(module, shard, whole) -> dict:
    """PrepareModuleInput's layouts for an attention or MLP module: its first input (x, or
    Hugging Face's hidden_states, passed by keyword) gathered from the sequence shards, the
    others (RoPE tables, masks, positions: torchtitan passes them positionally) left alone."""
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in kinds]
    if params and params[0].name == "hidden_states":
        return {"input_kwarg_layouts": {"hidden_states": shard},
                "desired_input_kwarg_layouts": {"hidden_states": whole}}
    rest = (None,) * max(0, len(params) - 1)
    return {"input_layouts": (shard, *rest), "desired_input_layouts": (whole, *rest)}


def apply(model, world_mesh=None, *, blocks=None, strict: bool = True):
    """parallelize_module on the "tp" dimension, the plan's checkpointing (checkpoint_blocks),
    then fully_shard each block and the root on the (replicate, shard) dimensions; returns the
    model."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = build_mesh() if world_mesh is None else world_mesh
    shape = tuple(mesh.shape)
    if strict and shape != (*MESH_SHAPE, TP_SIZE):
        raise ValueError(f"mesh {shape} is not the plan's (replicate, shard, tp) "
                         f"{(*MESH_SHAPE, TP_SIZE)}: launch {NUM_GPUS} ranks or pass strict=False")
    todo = default_blocks(model) if blocks is None else list(blocks)
    wrap_targets(model, todo, strict=strict)  # refuse before parallelize_module changes them
    for block in todo:
        parallelize_module(block, mesh["tp"], tp_plan(block))
    todo = checkpoint_blocks(model, todo, strict=strict)
    dp = mesh["replicate", "shard"]
    reshard = RESHARD_AFTER_FORWARD
    if not isinstance(reshard, bool) and not (1 < reshard < shape[1] and shape[1] % reshard == 0):
        reshard = True
    policy = mp_policy()
    for block in todo:
        fully_shard(block, mesh=dp, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dp, reshard_after_forward=reshard, mp_policy=policy)
    return model
'''


def render(job: Job, s: Strategy) -> str:
    head = [
        f'"""FSDP2 settings for {job.model.name} on {job.num_gpus} GPUs of {job.cluster.name}.',
        "",
        "Generated by `amsp export --to fsdp2`. Use:",
        "",
        "    import amsp_fsdp2",
        "    mesh = amsp_fsdp2.build_mesh()          # after init_process_group",
        "    amsp_fsdp2.apply(model, mesh)           # checkpoint the plan's blocks,",
        "                                            # fully_shard each, then the root",
        "    for i, batch in enumerate(micro_batches):",
        "        amsp_fsdp2.set_micro_batch(model, i)",
        "        loss(model(batch)).backward()",
        '"""',
        "",
        "from __future__ import annotations",
        "",
    ]
    consts = [f"{k} = {v!r}" for k, v in settings(job, s).items()]
    fp8 = ""
    if job.training.precision == "fp8":  # torchao's conversion (exports/fp8.py)
        from amsp_planner.exports.fp8 import FSDP2_BODY, fsdp2_settings

        consts += [f"{k} = {v!r}" for k, v in fsdp2_settings(job, s).items()]
        fp8 = FSDP2_BODY
    return ("\n".join(head + consts) + "\n" + _BODY + (_TP_BODY if s.tp > 1 else "")
            + (fsdp2_moe.BODY if s.has_experts else "") + fp8)


def export(job: Job, strategy: Strategy, memory_limit: float | None = None) -> ExportResult:
    def notes(s: Strategy) -> list[str]:
        out = []
        if s.hpz > 1:
            out.append("reshard_after_forward=int frees the in-node copy after backward (ZeRO++ "
                       "keeps it); memory peaks at the same point")
        if job.training.compile:
            out.append("priced compiled (--compile): torch.compile the blocks, as the plan does")
        return out

    return finish(TARGET, job, strategy, memory_limit, render, WHY, notes)


