"""`moesys bench NAME`: side-by-side performance ratios measured in one run (never in tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import typer
from rich.table import Table

from moesys_cli.options import Json
from moesys_cli.render import console, literal, print_json
from moesys_cli.resolve import resolve_config
from runtime.config import ConfigError, MoesysConfig


def _moe_layer(cfg: MoesysConfig) -> dict:
    from runtime.bench.moe_layer import run_moe_layer_bench
    return run_moe_layer_bench()


def _train(cfg: MoesysConfig, steps: int | None = None) -> dict:
    from runtime.bench.train import run_train_bench
    return run_train_bench(cfg) if steps is None else run_train_bench(cfg, steps)


def _ring(cfg: MoesysConfig) -> dict:
    from runtime.bench.ring import run_ring_bench
    return run_ring_bench(ring_slots=cfg.infer.ring_slots)


def _infer(cfg: MoesysConfig, size: str = "small") -> dict:
    from runtime.bench.infer import run_infer_bench
    return run_infer_bench(ring_slots=cfg.infer.ring_slots, size=size, compile=cfg.infer.compile)


def _offload_train(cfg: MoesysConfig, steps: int | None = None) -> dict:
    from runtime.bench.offload_train import run_offload_train_bench
    return run_offload_train_bench(cfg) if steps is None else run_offload_train_bench(cfg, steps)


def _offload(cfg: MoesysConfig) -> dict:
    from runtime.bench.offload import run_offload_bench
    return run_offload_bench()


def _embedding(cfg: MoesysConfig) -> dict:
    from runtime.bench.embedding import run_embedding_bench
    return run_embedding_bench(cfg)


def _elastic(cfg: MoesysConfig, steps: int | None = None) -> dict:
    from runtime.bench.elastic import run_elastic_bench
    return run_elastic_bench(cfg) if steps is None else run_elastic_bench(cfg, steps)


def _beyond_memory(cfg: MoesysConfig) -> dict:
    from runtime.bench.beyond_memory import run_beyond_memory_bench
    return run_beyond_memory_bench(cfg)


def _alltoall(cfg: MoesysConfig) -> dict:
    from runtime.bench.alltoall import run_alltoall_bench
    return run_alltoall_bench(cfg)


def _serve(cfg: MoesysConfig) -> dict:
    from runtime.bench.serve import run_serve_bench
    return run_serve_bench()


BENCHES: dict[str, Callable[[MoesysConfig], dict]] = {
    "moe-layer": _moe_layer,
    "train": _train,
    "ring": _ring,
    "infer": _infer,
    "offload": _offload,
    "offload-train": _offload_train,
    "embedding": _embedding,
    "elastic": _elastic,
    "beyond-memory": _beyond_memory,
    "alltoall": _alltoall,
    "serve": _serve,
}
HONOURED: dict[str, tuple[str, ...] | None] = {
    "moe-layer": (), "offload": (), "embedding": (), "ring": ("infer.ring_slots",),
    "infer": ("infer.ring_slots", "infer.compile"), "train": None, "offload-train": None, "elastic": None,
    "beyond-memory": (), "alltoall": None, "serve": (),
}
"""The override keys each benchmark uses (None: the whole resolved config); any other override is refused rather
than silently ignored, since a figure measured on another shape than asked for misleads."""
STEPS: dict[str, int] = {"train": 2, "elastic": 2, "offload-train": 4}
"""The benchmarks that run training jobs of their own length (8, 8 and 10 steps), which train.max_steps=N sets
instead, and the fewest steps each measures (its first steps are warm-up)."""
SIZES: dict[str, tuple[str, ...]] = {"infer": ("small", "large")}
"""The benchmarks that take --size, and their presets (runtime/bench/infer.py SIZES)."""


VALUE_HINT = {"infer.ring_slots": "N", "infer.compile": "true|false"}
"""How --help writes the value of each key a fixed-shape benchmark honours."""


def _overrides_help() -> str:
    """What each benchmark takes of key=value overrides, from HONOURED."""
    whole = [name for name, keys in HONOURED.items() if keys is None]
    some: dict[tuple[str, ...], list[str]] = {}
    for name, keys in HONOURED.items():
        if keys:
            some.setdefault(keys, []).append(name)
    fixed = [name for name, keys in HONOURED.items() if keys == ()]
    parts = [f"{', '.join(whole)}: recipe=NAME and any key=value override ({', '.join(STEPS)}: train.max_steps=N "
             "sets each job's steps)"]
    parts += [f"{', '.join(names)}: only {', '.join(f'{k}={VALUE_HINT[k]}' for k in keys)}"
              for keys, names in some.items()]
    parts.append(f"{', '.join(fixed)}: none (they measure a fixed shape; an override is refused)")
    return "Overrides, by benchmark. " + "; ".join(parts) + "."


BenchOverrides = Annotated[list[str] | None, typer.Argument(help=_overrides_help(), show_default=False)]


def _check_overrides(name: str, overrides: list[str]) -> None:
    honoured = HONOURED[name]
    if honoured is None:
        return
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if key not in honoured:
            allowed = f"only {', '.join(honoured)}" if honoured else "no key=value overrides"
            raise ConfigError(f"moesys bench {name} takes {allowed} (it measures a fixed shape side by side); "
                              f"drop {key}")


Size = Annotated[str | None, typer.Option(
    "--size", help="infer only: the model's shape, small (1.6 GB, the default; runs on a laptop CPU) or large "
                   "(a 16-layer Mixtral, 11.9 GB, for a GPU).", show_default=False)]


def _steps(name: str, overrides: list[str], cfg: MoesysConfig) -> dict[str, int]:
    """{"steps": train.max_steps} for a benchmark of STEPS when the user gave train.max_steps (its own length
    otherwise: the recipe's max_steps is a training run's, not a measurement's); refused below its fewest."""
    given = any(o.partition("=")[0].lstrip("+~") == "train.max_steps" for o in overrides)
    if name not in STEPS or not given:
        return {}
    if cfg.train.max_steps < STEPS[name]:
        raise ConfigError(f"moesys bench {name} measures at least {STEPS[name]} steps (the first are warm-up); "
                          f"train.max_steps={cfg.train.max_steps} is fewer")
    return {"steps": cfg.train.max_steps}


def _check_size(name: str, size: str | None) -> None:
    if size is None:
        return
    if name not in SIZES:
        raise ConfigError(f"moesys bench {name} takes no --size (only {', '.join(SIZES)} does)")
    if size not in SIZES[name]:
        raise ConfigError(f"--size {size!r} is not one of {', '.join(SIZES[name])}")


def bench(name: Annotated[str, typer.Argument(help=f"one of: {', '.join(BENCHES)}")],
          overrides: BenchOverrides = None, json_out: Json = False, size: Size = None) -> None:
    """Measure side by side and print the ratios (JSON with --json)."""
    if name not in BENCHES:
        raise ConfigError(f"unknown benchmark {name!r}; available: {', '.join(BENCHES)}")
    _check_overrides(name, overrides or [])
    _check_size(name, size)
    cfg = resolve_config(overrides or [])
    steps = _steps(name, overrides or [], cfg)
    if not json_out:
        console.print(f"[bold]moesys bench {name}[/]: measuring (this takes a minute or two)...")
    result = BENCHES[name](cfg, **({"size": size} if size is not None else {}), **steps)
    if json_out:
        print_json(result)
        return
    table = Table(title=f"moesys bench {name}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, text in _rows(result):
        key, text = literal(key), literal(text)
        bold = "_vs_" in key.rsplit(".", 1)[-1] and not key.endswith("_rounds")
        table.add_row(f"[bold]{key}[/]" if bold else key, f"[bold]{text}[/]" if bold else text)
    console.print(table)


def _rows(result: dict, prefix: str = ""):
    """(dotted key, text) for every leaf: nested results (by_batch, by_input, model) flattened, floats to 3 places,
    lists of floats (per-round ratios) on one line."""
    for key, value in result.items():
        if isinstance(value, dict):
            yield from _rows(value, f"{prefix}{key}.")
        elif isinstance(value, float):
            yield f"{prefix}{key}", f"{value:.3f}"
        elif isinstance(value, list) and all(isinstance(v, float) for v in value):
            yield f"{prefix}{key}", " ".join(f"{v:.2f}" for v in value)
        else:
            yield f"{prefix}{key}", str(value)
