"""The pieces of ``tools/train_moe.py`` (the main job), shared with ``tools/bench_moe_layer.py``.

Modules:
    data: the corpus as byte tokens, its held-out split, deterministic batches and seeds.
    model: ``ByteMoELM``, the byte-level transformer whose MLPs are DeepSpeed MoE layers.
    recipes: ds_configs and the ``fp4_moe`` sections of the bf16/fp8/fp4 recipes.
    launch: process environment, logging and device of a rank.
    metrics: all-to-all bytes, memory, losses of a run; its CSV/JSON files.
    curve_files: opening a run's per-step curve file, text or gzipped (no torch).
    report: the end-of-run table, the deviations from bf16 and the ``--compare`` PNG.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the tools run from a checkout: make `import ds_fp4` work
    sys.path.insert(0, str(REPO))
