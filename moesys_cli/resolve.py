"""Resolve `recipe=NAME key=value ...` into one validated MoesysConfig with Hydra's Compose API.

The schema dataclasses are registered in the ConfigStore, so a misspelled key fails at compose time; recipes/*.yaml
are registered as the `recipe` group (package _global_). Every verb calls `resolve_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import typing
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runtime.config import ConfigError, MoesysConfig, resolve_auto, validate
from runtime.config.keys import keys_meant
from runtime.config.schema import AUTO_LAYERS
from runtime.files.paths import expert_store_root
from runtime.host.topology import detect_machine
from runtime.plan.schedule import apply_schedule
from runtime.train.lr_width import lr_width_warning

GROUPS = ("model", "topology", "storage", "train", "infer", "launcher", "recipe")
AUTO_KEYS = {"topology.expert_parallel": 0, "train.grad_accum_steps": 0, "storage.resident_layers": AUTO_LAYERS}
"""Integer keys that also take `auto`, and the value the schema stores for it: runtime.config.resolve_auto replaces
topology.expert_parallel's, the plan's schedule the others (runtime/plan/schedule.py)."""


def _data_dir(name: str) -> Path:
    """conf/ or recipes/: inside the installed package, or beside moesys_cli/ in a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    raise ConfigError(f"moesys is installed without its {name}/ directory; reinstall with `pip install moesys`")


def conf_dir() -> Path:
    return _data_dir("conf")


def recipes_dir() -> Path:
    return _data_dir("recipes")


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def group_options(group: str) -> list[str]:
    if group == "recipe":
        return available_recipes()
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _register(extra: dict[str, Path]) -> None:
    cs = ConfigStore.instance()
    cs.store(name="moesys_schema", node=MoesysConfig)
    paths = {p.stem: p for p in sorted(recipes_dir().glob("*.yaml"))} | extra
    for name, path in paths.items():
        node = _auto_to_zero(load_recipe(path))
        if name in extra:  # a user's file: its keys checked as on the command line (ours are tested)
            check_recipe_keys(node, path)
        cs.store(group="recipe", name=name, node=node, package="_global_")


def load_recipe(path: Path) -> dict:
    """A recipe file's YAML mapping; a file that cannot be read or parsed, or holds no mapping, is a one-line
    ConfigError naming it and where it stops parsing."""
    try:
        node = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"recipe {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"recipe {path} is not valid YAML: {problem}{where}") from None
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise ConfigError(f"recipe {path} is not a YAML mapping of config keys (it holds a {type(node).__name__})")
    return node


def check_recipe_keys(node: dict, path: Path, prefix: str = "") -> None:
    """Reject an unknown key of a recipe file with check_override's message (Hydra's names neither key nor file)."""
    for key, value in node.items():
        if not prefix and key == "defaults":
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            check_recipe_keys(value, path, f"{dotted}.")
            continue
        try:
            check_key(dotted)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in recipe {path})") from None


def _auto_to_zero(node: dict) -> dict:
    """`key: auto` in a recipe, for the AUTO_KEYS, as the schema's value for it (OmegaConf has no int-or-str
    fields)."""
    for dotted, stored in AUTO_KEYS.items():
        *path, name = dotted.split(".")
        parent: dict | None = node
        for part in path:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict) and str(parent.get(name)).lower() == "auto":
            parent[name] = stored
    return node


def _field_type(cls: type, name: str):
    hints = typing.get_type_hints(cls)
    return hints.get(name)


def recipe_file(value: str) -> Path | None:
    """A recipe given as a path to a YAML file (e.g. one written by `moesys rebalance --write`)."""
    path = Path(value).expanduser()
    return path.resolve() if value.endswith((".yaml", ".yml")) and path.is_file() else None


def recipe_text(name: str) -> str:
    """The YAML of a recipe, by name or by path."""
    return (recipe_file(name) or recipes_dir() / f"{name}.yaml").read_text()


def check_override(override: str) -> None:
    """Reject an unknown dotted key or group option with the closest valid names, before Hydra sees it."""
    key, sep, value = override.partition("=")
    if not sep:
        raise ConfigError(f"override {override!r} is not key=value (e.g. model.num_experts=16)")
    key = key.lstrip("+~")
    if key == "recipe" and recipe_file(value):
        return
    if key in GROUPS:
        options = group_options(key)
        if value not in options:
            close = difflib.get_close_matches(value, options, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(f"unknown {key} {value!r}; {hint}available: {', '.join(options)}")
        return
    check_key(key)


def check_key(key: str) -> None:
    """Reject a dotted key the schema does not have, with the closest valid names."""
    cls: typing.Any = MoesysConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        origin = typing.get_origin(cls)
        if origin is dict:
            cls = typing.get_args(cls)[1]
            continue
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ConfigError(f"unknown config key {key}: {'.'.join(parts[:i])} has no sub-keys")
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            prefix = ".".join(parts[:i])
            full = [f"{prefix}.{n}" if prefix else n for n in names]
            close = [full[names.index(c)] for c in difflib.get_close_matches(part, names, n=3)]
            if len(parts) == 1:  # a key without its section (max_steps): the keys it names come first
                close = keys_meant(part) or close
            hint = f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(full)}"
            raise ConfigError(f"unknown config key {key}; {hint}")
        cls = _field_type(cls, part)
        if typing.get_origin(cls) is typing.Union:
            cls = next(a for a in typing.get_args(cls) if a is not type(None))


def _one_line(exc: BaseException) -> str:
    """Hydra wraps the useful message (e.g. a type error) as the cause; keep the first line of each."""
    lines = [str(e).strip().splitlines()[0] for e in (exc, exc.__cause__) if e is not None and str(e).strip()]
    return ": ".join(lines) or type(exc).__name__


def resolve_config(overrides: list[str] | tuple[str, ...] = (), schedule: bool = True) -> MoesysConfig:
    """Compose conf/ + recipe + overrides, convert to dataclasses, fill machine facts, validate once, and replace the
    schedule's auto keys by the plan's choice (runtime/plan/schedule.py; schedule=False leaves them to the caller)."""
    overrides = list(overrides)
    for override in overrides:
        check_override(override)
    files: dict[str, Path] = {}
    for i, override in enumerate(overrides):
        key, _, value = override.partition("=")
        path = recipe_file(value) if key == "recipe" else None
        if key.lstrip("+~") in AUTO_KEYS and value.strip().lower() == "auto":
            stored = AUTO_KEYS[key.lstrip("+~")]
            overrides[i] = f"{key}={'null' if stored is None else stored}"
        if path:
            name = "file-" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
            files[name] = path
            overrides[i] = f"recipe={name}"
    _register(files)
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name="moesys"):
            composed = compose(config_name="config", overrides=overrides)
        cfg = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_one_line(exc)) from None
    assert isinstance(cfg, MoesysConfig)
    if cfg.topology.detect:
        _apply_machine(cfg)
    if cfg.train.init_from:  # the model section is the checkpoint's; only the user's own model.* keys are checked
        from runtime.train.init_from import apply_init_from

        apply_init_from(cfg, explicit_keys(overrides))
    resolve_auto(cfg)
    validate(cfg)
    if not schedule:
        return cfg
    chosen = apply_schedule(cfg)
    if chosen is not cfg:
        validate(chosen)
    return chosen


def explicit_keys(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The dotted keys (and groups) the user set on the command line, as opposed to a recipe's or the defaults'."""
    return {o.partition("=")[0].lstrip("+~") for o in overrides} - {"recipe"}


def lr_warning(cfg: MoesysConfig, overrides: list[str] | tuple[str, ...]) -> str | None:
    """A warning when train.lr is the recipe's own (not overridden) and the overrides made the model much wider
    than the recipe's (runtime/train/lr_width.py); None otherwise."""
    keys = [o.partition("=")[0].lstrip("+~") for o in overrides]
    if "train.lr" in keys or not any(k == "model" or k.startswith("model.") for k in keys):
        return None  # the user chose the lr, or the recipe's model is unchanged
    recipe = [o for o in overrides if o.partition("=")[0] == "recipe"][-1:]
    try:
        base = resolve_config(recipe)
    except ConfigError:
        return None
    return lr_width_warning(cfg.train.lr, cfg.model.hidden_size, cfg.recipe or "default", base.train.lr,
                            base.model.hidden_size)


def _apply_machine(cfg: MoesysConfig) -> None:
    machine = detect_machine(str(expert_store_root(cfg)))
    t = cfg.topology
    t.gpus_per_node = machine.gpus
    t.gpu_memory_gb = machine.gpu_memory_gb
    t.cpu_memory_gb = machine.cpu_memory_gb
    t.ssd_gb = machine.ssd_free_gb
    t.nproc_per_node = machine.gpus or t.nproc_per_node
    t.detect = False


def config_yaml(cfg: MoesysConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
