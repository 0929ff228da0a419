# Stage `release` (GPU runs, after `evaluate`): each of release.tags (`selected`, `final`)
# as a Hugging Face model directory under <release.dir>/<run>/<tag>/ (never an output: a
# rerun must not delete a release), verified against the base model and against the weights
# its evaluation loaded, with a model card written from the records (hy3rl.release,
# docs/formats/release.md). Its output is release/<tag>/release.json, written only when
# every check passed; release/<tag>/checks.json holds the checks, passed or not. It runs
# after the report, whose copy goes beside the card (a refused release never withholds the
# report). The input functions are in rules/common.smk (release section).


if gpu_enabled():

    STAGE_TARGETS.append(release_page_targets)

    rule release_model:
        input:
            unpack(release_inputs),
        output:
            record=LAYOUT.release_record("{rtag}"),
        log:
            LAYOUT.log("release/{rtag}"),
        wildcard_constraints:
            rtag="selected|final",
        threads: release_threads()
        resources:
            **release_job_resources(),
        params:
            **triggers(*release_trigger_keys()),
        script:
            "../scripts/adapters/release_model.py"

    # report/releases.html: every release with its checks, linked from the report (which
    # runs beside the releases, so it cannot show them itself); hy3rl.report.releases.
    rule release_page:
        input:
            release_targets(),
        output:
            LAYOUT.releases_page,
        log:
            LAYOUT.log("release/page"),
        localrule: True
        threads: 1
        resources:
            mem_mb=1000,
            runtime=10,
        params:
            **triggers("run.name", "release.tags", "report.redact_env"),
        script:
            "../scripts/adapters/release_page.py"

    # The target users type: every release of release.tags, and their page.
    rule release:
        input:
            release_page_targets(),
        localrule: True
