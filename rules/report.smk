# Stage `report`: one self-contained HTML page of everything the run produced, plus the
# figures as PNG and the tables as CSV beside it (docs/formats/report.md). It runs after
# every other target of `all` and renders whatever exists (a stage that did not run is
# shown with the reason). The outputs are report() items, so `snakemake --report` gives
# the same record.
from hy3rl.config import config_hash
from hy3rl.redact import redact_config

REPORT_DIR = f"{RESULTS}/report"
# The resolved config for the report, secret-looking values redacted (rule params are
# copied into `snakemake --report`'s record), and the hash of the full config.
REPORT_CFG = json.dumps(redact_config(config), sort_keys=True)
REPORT_CFG_HASH = config_hash(config)

STAGE_TARGETS.append(lambda: [f"{REPORT_DIR}/index.html"])


rule report:
    input:
        # every other target of `all`: the report comes last and sees all of them
        lambda wc: [t for t in all_inputs() if not t.startswith(f"{REPORT_DIR}/")],
    output:
        html=report(
            f"{REPORT_DIR}/index.html",
            caption="../report/captions/index.rst",
            category="1. Report",
        ),
        config=report(
            f"{REPORT_DIR}/config.resolved.yaml",
            caption="../report/captions/config.rst",
            category="5. Provenance",
        ),
        fig_training_published=report(
            f"{REPORT_DIR}/fig_training_published.png",
            caption="../report/captions/fig_training_published.rst",
            category="2. Training",
        ),
        fig_training_extra=report(
            f"{REPORT_DIR}/fig_training_extra.png",
            caption="../report/captions/fig_training_extra.rst",
            category="2. Training",
        ),
        fig_step_time=report(
            f"{REPORT_DIR}/fig_step_time.png",
            caption="../report/captions/fig_step_time.rst",
            category="2. Training",
        ),
        fig_eval_checkpoints=report(
            f"{REPORT_DIR}/fig_eval_checkpoints.png",
            caption="../report/captions/fig_eval_checkpoints.rst",
            category="4. Evaluation",
        ),
        fig_eval_heatmap=report(
            f"{REPORT_DIR}/fig_eval_heatmap.png",
            caption="../report/captions/fig_eval_heatmap.rst",
            category="4. Evaluation",
        ),
        stages=report(
            f"{REPORT_DIR}/stages.csv",
            caption="../report/captions/stages.rst",
            category="1. Report",
        ),
        attempts=report(
            f"{REPORT_DIR}/attempts.csv",
            caption="../report/captions/attempts.rst",
            category="2. Training",
        ),
        claims=report(
            f"{REPORT_DIR}/claims.csv",
            caption="../report/captions/claims.rst",
            category="3. Claims",
        ),
        eval_headline=report(
            f"{REPORT_DIR}/eval_headline.csv",
            caption="../report/captions/eval_headline.rst",
            category="4. Evaluation",
        ),
        eval_per_problem=report(
            f"{REPORT_DIR}/eval_per_problem.csv",
            caption="../report/captions/eval_per_problem.rst",
            category="4. Evaluation",
        ),
        eval_paired=report(
            f"{REPORT_DIR}/eval_paired.csv",
            caption="../report/captions/eval_paired.rst",
            category="4. Evaluation",
        ),
        provenance=report(
            f"{REPORT_DIR}/provenance.csv",
            caption="../report/captions/provenance.rst",
            category="5. Provenance",
        ),
    log:
        f"{LOGS}/report.log",
    conda:
        "../envs/workflow.yaml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=15,
    params:
        cfg=REPORT_CFG,
        cfg_hash=REPORT_CFG_HASH,
        out=lambda wc, output: os.path.dirname(output.html),
        results=lambda wc, output: os.path.dirname(os.path.dirname(output.html)),
    shell:
        "python -m hy3rl.report --results {params.results:q} --out-dir {params.out:q}"
        " --config-json {params.cfg:q} --config-hash {params.cfg_hash} > {log} 2>&1"
