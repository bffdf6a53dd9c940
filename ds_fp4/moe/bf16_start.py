"""``fp4_moe.bf16_start_steps``: DeepSpeed's own bf16 layer for a run's first optimizer steps.

Why: on the main job's convergence model the low-precision recipes' loss gap to bf16 forms
early, while the loss falls fastest. Recipes branched from a bf16 run's step-1000
checkpoint and trained to 3000 drift from bf16 by +0.22% (fp4) and +0.09% (fp8) of train
loss (5 seeds, against both bf16 draws), where whole runs of the same recipes end +0.70%
and +0.41% above bf16 (15 seeds; bench/results/branches_h200_1gpu, session 22).

A layer reads the optimizer step from the DeepSpeed engine that ``ds_fp4.initialize`` or
``ds_fp4.configure`` made or was given (``engine.global_steps``: restored by
``load_checkpoint``, counted per optimizer step whatever the gradient accumulation), so
the switch happens between steps and a resumed run switches where the first run would have.
"""

import weakref

_NO_ENGINE = ("fp4_moe.bf16_start_steps = {n} needs the DeepSpeed engine's step count, and "
              "this layer has no engine: build the engine with ds_fp4.initialize, or call "
              "ds_fp4.configure(engine) after deepspeed.initialize (ds_fp4.convert alone "
              "never sees the engine), or set bf16_start_steps to 0")


def attach(model, engine) -> None:
    """Let every ds_fp4 layer of ``model`` read ``engine.global_steps`` (a weak reference:
    the layers do not keep the engine alive)."""
    ref = weakref.ref(engine)
    for module in model.modules():
        if hasattr(module, "fp4_setup"):
            module._fp4_engine = ref


def in_bf16_start(layer) -> bool:
    """Whether ``layer`` runs DeepSpeed's own forward at this step.

    Raises:
        RuntimeError naming the fix when the config asks for a bf16 start and the layer
        has no engine to count steps with.
    """
    steps = layer.fp4_config.bf16_start_steps
    if not steps:
        return False
    ref = getattr(layer, "_fp4_engine", None)
    engine = ref() if ref is not None else None
    if engine is None:
        raise RuntimeError(_NO_ENGINE.format(n=steps))
    return engine.global_steps < steps
