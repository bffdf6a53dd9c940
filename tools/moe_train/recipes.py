"""ds_configs of a run and the ``fp4_moe`` sections of the bf16, fp8 and fp4 recipes."""

import copy
import json
from pathlib import Path

from . import REPO
from .checks import RunError

# Per-recipe ds_config examples whose fp4_moe section --compare uses.
RECIPE_FILES = {"bf16": "bf16_moe.json", "fp8": "fp8_moe.json", "fp4": "fp4_moe.json"}


def read_json(path, flag="--deepspeed_config"):
    """The parsed JSON file at ``path``; RunError naming ``flag`` and the path when it
    cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as err:
        raise RunError(f"{flag} {path}: cannot be read ({err.strerror}); pass the path of a "
                       f"ds_config JSON file") from None
    except json.JSONDecodeError as err:
        raise RunError(f"{flag} {path}: not valid JSON ({err}); fix the file or pass another "
                       f"ds_config") from None


def recipe_section(recipe):
    """The ``fp4_moe`` section of a recipe name (``bf16``, ``fp8``, ``fp4``) or ds_config path."""
    path = REPO / "ds_config_examples" / RECIPE_FILES[recipe] if recipe in RECIPE_FILES else Path(recipe)
    if not path.is_file():
        raise ValueError(f"recipe {recipe!r}: {path} does not exist; use one of "
                         f"{', '.join(RECIPE_FILES)} or the path of a ds_config with an fp4_moe section")
    cfg = read_json(path, "--recipe/--compare")
    # A ds_config without the section runs DeepSpeed's own layer.
    return copy.deepcopy(cfg.get("fp4_moe", {"enabled": False}))


def base_config(args):
    """The ds_config of this run: ``--deepspeed_config``, else the FP4 recipe's example."""
    path = args.deepspeed_config or REPO / "ds_config_examples" / RECIPE_FILES["fp4"]
    cfg = read_json(path)
    if args.recipe:
        cfg["fp4_moe"] = recipe_section(args.recipe)
    return cfg


def finish_config(cfg, args):
    """Set the batch keys DeepSpeed needs from the run's sizes (the config's own win)."""
    cfg = copy.deepcopy(cfg)
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    cfg.setdefault("gradient_accumulation_steps", 1)
    cfg.pop("train_batch_size", None)  # DeepSpeed derives it from the two above
    cfg.setdefault("steps_per_print", 10**9)  # the progress bar reports instead
    return cfg


def run_name(args, recipe=None):
    """A short label: the recipe name, else the ds_config file's name without .json."""
    recipe = recipe or args.recipe or args.deepspeed_config
    if not recipe:
        return "fp4"
    if recipe in RECIPE_FILES:
        return recipe
    by_file = {f: name for name, f in RECIPE_FILES.items()}  # fp4_moe.json -> fp4
    return by_file.get(Path(recipe).name, Path(recipe).stem)
