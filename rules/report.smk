# Stage `report`: one self-contained HTML page of everything the run produced, plus the
# figures as PNG and the tables as CSV beside it (docs/formats/report.md). It runs after
# every other target of `all` and renders whatever exists (a stage that did not run is
# shown with the reason). Its outputs are hy3rl.layout.REPORT_FILES, declared as report()
# items (common.smk, report_outputs), so `snakemake --report` gives the same record.
# The job reads the whole config (redacted before anything is written); only the report
# section and the run name re-run it by themselves: every other stage's change reaches it
# through its inputs.

STAGE_TARGETS.append(report_targets)


rule report:
    input:
        report_inputs,
    output:
        **report_outputs(),
    log:
        LAYOUT.log("report"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=15,
    params:
        **triggers("run.name", "report"),
    script:
        "../scripts/adapters/report.py"
