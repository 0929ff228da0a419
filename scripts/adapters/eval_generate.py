# Adapter of rule eval_generate (rules/eval.smk) -> hy3rl.evaluate.run. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import evalckpt, evaluate
from hy3rl.layout import Layout
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    tag, inp, out = snakemake.wildcards.tag, snakemake.input, snakemake.output
    model = evaluate.model_for_tag(cfg, tag, inp.get("train_done"))
    evaluate.run(
        cfg.eval, tag=tag, model=model,
        val=Path(inp.val), samples=Path(out.samples), meta=Path(out.meta),
        runtime_env=Path(inp.runtime_env) if inp.get("runtime_env") else None,
        ray_dir=Path(Layout.from_config(cfg).eval_ray_dir(tag)),
        cpus_per_node=cfg.cluster.cpus_per_node, runtime=cfg.train.runtime, ray=cfg.train.ray)
    evalckpt.keep_only_request(Layout.from_config(cfg), tag, Path(inp.request))
    if inp.get("ready"):  # a step's checkpoint: retention may let it go once all have read it
        evalckpt.mark_read(Path(evaluate.checkpoint_dir_of(model)), tag, Path(inp.request))
