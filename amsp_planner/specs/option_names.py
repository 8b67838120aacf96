"""The CLI option behind each TrainingSpec field (``--global-batch`` for
``global_batch_tokens``), so that every error about the training options, from ``amsp plan``
or a what-if point, names what the user typed rather than an internal field.
"""

from __future__ import annotations

import re

OPTION_OF = {"seq_len": "--seq-len", "global_batch_tokens": "--global-batch",
             "global_batch_seqs": "--global-batch-seqs", "micro_batch": "--micro-batch",
             "activation_checkpointing": "--activation-checkpointing",
             "precision": "--precision", "grad_accum_dtype": "--grad-accum-dtype",
             "activation_profile": "--activation-profile", "fp8_recipe": "--fp8-recipe",
             "fp8_all_gather": "--fp8-all-gather", "tp_overlap": "--tp-overlap"}
"""The option that sets each TrainingSpec field."""
_FIELD = re.compile(r"\b(" + "|".join(OPTION_OF) + r")\b")


def as_options(text: str) -> str:
    """`text` with TrainingSpec's field names replaced by the options that set them."""
    return _FIELD.sub(lambda m: OPTION_OF[m.group(1)], text)


def training_error(exc) -> str:
    """One line from TrainingSpec's ValidationError, naming the options (``--global-batch``),
    not the fields (``global_batch_tokens``)."""
    from amsp_planner.errors import readable

    parts = []
    for err in exc.errors():
        msg = as_options(err.get("msg", "invalid value").removeprefix("Value error, "))
        field = ".".join(str(p) for p in err.get("loc", ()))
        opt = OPTION_OF.get(field.split(".")[0])
        parts.append(msg if not opt or opt in msg else f"{opt}: {msg}")
    return readable("; ".join(parts))
