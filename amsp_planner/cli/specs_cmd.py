"""amsp specs list|show: the presets and their derived figures.

    amsp specs show llama-7b
"""

from __future__ import annotations

import click


@click.group()
def specs():
    """List the model and cluster presets, or show one with its derived figures."""


@specs.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_cmd(as_json):
    """Names of the model and cluster presets."""
    from amsp_planner.specs import list_presets

    data = {"models": list_presets("model"), "clusters": list_presets("cluster")}
    if as_json:
        import json

        click.echo(json.dumps(data, indent=2))
        return
    click.echo("models:   " + ", ".join(data["models"]))
    click.echo("clusters: " + ", ".join(data["clusters"]))


def _kind(name: str) -> str:
    """'cluster' or 'model': presets by name, files and folders by their content."""
    from pathlib import Path

    from amsp_planner.specs import list_presets
    from amsp_planner.specs.loader import ALIASES, _read_mapping, _resolve, is_hf_config
    from amsp_planner.textfile import path_too_long

    if name in list_presets("cluster") or name in ALIASES["cluster"]:
        return "cluster"
    if path_too_long(name):
        _resolve(name, "model")  # refuses it in one line (Path.exists would raise)
    p = Path(name)
    if name in list_presets("model") or name in ALIASES["model"] or not (p.exists() or p.suffix):
        return "model"
    data = _read_mapping(_resolve(name, "model"))
    return "cluster" if "gpu" in data and not is_hf_config(data) else "model"


def describe(name: str) -> dict:
    """Derived figures of a model or cluster preset (or spec file, or Hugging Face folder)."""
    from amsp_planner.errors import AmspUserError
    from amsp_planner.specs import list_presets, load_cluster, load_model

    if _kind(name) == "cluster":
        c = load_cluster(name)
        from amsp_planner.topology import Topology

        topo = Topology(c, c.gpus_per_node * 2)
        return {
            "kind": "cluster", "spec": c.model_dump(),
            "derived": {
                "gpu_memory_bytes": c.memory_bytes,
                "achievable_tflop_per_s": c.achievable_flop_per_s / 1e12,
                "intra_bus_gbyte_per_s_per_gpu": topo.intra_bw / 1e9,
                "node_nic_gbyte_per_s": topo.node_bw / 1e9,
                "node_spine_share_gbyte_per_s": c.node_nic_bytes_per_s / c.oversubscription / 1e9,
            },
        }
    try:
        m = load_model(name)
    except AmspUserError as e:
        if "unknown model" not in str(e):
            raise
        raise AmspUserError(
            f"unknown preset '{name}': use one of {', '.join(list_presets('model'))} or "
            f"{', '.join(list_presets('cluster'))}, or a spec file or Hugging Face model folder"
        ) from None
    return {
        "kind": "model", "spec": {**m.model_dump(), "num_kv_heads": m.kv_heads,
                                  "head_dim": m.head_dim},
        "derived": {
            "params": m.num_params, **_moe_figures(m), "flop_params": m.num_flop_params,
            "units": len(m.unit_params()), "largest_unit_params": max(m.unit_params()),
            "flops_per_token_seq4096": m.flops_per_token(4096),
            "model_state_bytes_mixed_adam": 16 * m.num_params,
        },
    }


def _moe_figures(m) -> dict:
    """A mixture of experts' active parameters, its MoE layers and its two parameter classes
    (the experts' count and top-k are spec fields; nothing for a dense model)."""
    if not m.is_moe:
        return {}
    routed = sum(m.unit_expert_params())
    return {
        "active_params": m.num_active_params,
        "moe_layers": m.num_moe_layers,
        "params_per_expert": m.expert_params(),
        "routed_expert_params": routed,
        "dense_params": m.num_params - routed,
    }


def _value(v) -> str:
    if v is None:
        return "default"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.0f}" if v.is_integer() and abs(v) >= 1e4 else f"{v:,.6g}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, list):
        return "none" if not v else f"{len(v)} entries (see --json)"
    if isinstance(v, tuple):  # layer indices (dense_layers, sliding_layers)
        return ", ".join(map(str, v)) if len(v) <= 8 else f"{len(v)} entries (see --json)"
    return str(v)


def spec_lines(d: dict) -> list[str]:
    """`specs show` text: one 'field: value' line each, groups of fields indented."""
    lines = [f"{d['kind']} {d['spec']['name']}"]
    for k, v in d["spec"].items():
        if k == "name":
            continue
        if isinstance(v, dict):
            lines.append(f"  {k}:")
            lines += [f"    {kk}: {_value(vv)}" for kk, vv in v.items()]
        else:
            lines.append(f"  {k}: {_value(v)}")
    lines.append("derived:")
    lines += [f"  {k}: {_value(v)}" for k, v in d["derived"].items()]
    return lines


@specs.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def show_cmd(name, as_json):
    """A preset's fields and derived figures (parameters, FLOPs/token, bandwidths).

    NAME: a preset, a spec file, or a Hugging Face model folder (or its config.json).
    """
    import json

    from amsp_planner.errors import AmspUserError

    try:
        d = describe(name)
    except AmspUserError as e:  # the loaders name --model; this command's input is NAME
        text = str(e)
        for head in ("--model: ", "--model ", "--cluster: ", "--cluster "):
            if text.startswith(head):
                rest = text[len(head):]
                raise AmspUserError(f"NAME {rest}" if rest.startswith("is empty") else rest) \
                    from None
        raise
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    for line in spec_lines(d):
        click.echo(line)
