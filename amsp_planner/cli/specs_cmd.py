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


def describe(name: str) -> dict:
    """Derived figures of a model or cluster preset (or spec file)."""
    from amsp_planner.errors import AmspUserError
    from amsp_planner.specs import list_presets, load_cluster, load_model

    if name in list_presets("cluster") or (name not in list_presets("model") and _is_cluster(name)):
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
    except AmspUserError:
        raise AmspUserError(
            f"unknown preset '{name}': use one of {', '.join(list_presets('model'))} or "
            f"{', '.join(list_presets('cluster'))}"
        ) from None
    return {
        "kind": "model", "spec": m.model_dump(),
        "derived": {
            "params": m.num_params, "flop_params": m.num_flop_params,
            "units": len(m.unit_params()), "largest_unit_params": max(m.unit_params()),
            "flops_per_token_seq4096": m.flops_per_token(4096),
            "model_state_bytes_mixed_adam": 16 * m.num_params,
        },
    }


def _is_cluster(name: str) -> bool:
    from pathlib import Path

    p = Path(name)
    if not p.exists():
        return False
    import yaml

    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError:
        return False
    return isinstance(data, dict) and "gpu" in data


@specs.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def show_cmd(name, as_json):
    """A preset's fields and derived figures (parameters, FLOPs/token, bandwidths)."""
    import json

    d = describe(name)
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    click.echo(f"{d['kind']} {d['spec']['name']}")
    for k, v in d["spec"].items():
        if k != "name":
            click.echo(f"  {k}: {v}")
    click.echo("derived:")
    for k, v in d["derived"].items():
        click.echo(f"  {k}: {v:,.6g}" if isinstance(v, float) else f"  {k}: {v:,}")
