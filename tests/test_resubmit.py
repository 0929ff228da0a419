"""The controller's resubmission guard (hy3rl.resubmit; rules/common.smk train_slurm_extra).

- crash_loop on record sequences as the training job writes them (hy3rl.train's
  AttemptRecord): a loop, progress in between, early failures repeating, a time-limit stop
  breaking the chain, a hang twice at the same step.
- decide() on real files under a run's train/attempts/: job-exit.json with retry false
  stops; nodes to exclude merge (job-exit, lost nodes, earlier decisions); only what this
  invocation wrote counts; a NODE_FAIL without job-exit.json (SLURM's answers injected:
  no SLURM here); submissions.jsonl lines; unreadable files are named.
- The real Snakemake CLI on the repository's Snakefile: rules train and train_segment are
  resubmitted max_submissions - 1 times, the guard stops the workflow before a submission
  (a crash loop; two jobs that left nothing), and neither a dry run nor the job's own
  Snakemake (exec mode remote) decides anything; the SLURM profile keeps `retries: 0`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from fixtures.common import REPO_ROOT, make_config, run_snakemake
from fixtures.trainer_double import plan_json
from hy3rl.atomic import write_json_atomic
from hy3rl.ckptdir import LOCK_NAME, my_lock_info
from hy3rl.layout import Layout
from hy3rl.resubmit import (
    Decision,
    ResubmitError,
    SlurmJob,
    crash_loop,
    decide,
    node_unusable,
    parse_sacct,
    parse_scontrol_job,
    with_exclude,
)
from hy3rl.train import AttemptRecord

# The controller started half an hour before this module was imported: the first job's
# records are dated before now, where decide() dates its decisions; a later job's records
# after. LATER is a week on, not an hour: a test may run long after collection (a full run
# takes over half an hour, and one that dated LATER an hour on failed in it).
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=30)
SINCE = T0.isoformat(timespec="seconds")
LATER = 7 * 24 * 60  # minutes after T0: after any decision this session takes


def at(minutes: float) -> str:
    """A record time ``minutes`` after the controller started (negative: before)."""
    return (T0 + timedelta(minutes=minutes)).isoformat(timespec="seconds")


def record(k: int, outcome: str, start: int, end: int | None, *, logged: int | None = None,
           failed_at: int | None = None, error: str | None = None, started: float = 1.0,
           job: str | None = "4711", nodes: tuple[str, ...] = ("gpu01", "gpu02"),
           lost: tuple[str, ...] = ()) -> dict:
    """An attempt record as hy3rl.train writes it (its AttemptRecord, then closed)."""
    rec = dataclasses.asdict(AttemptRecord(
        attempt=k, run="r", executor="slurm" if job else "local", slurm_job_id=job,
        host="gpu01", nodes=list(nodes), num_nodes=len(nodes), gpus_per_node=8,
        cpus_per_node=64, submission_id=f"r-{job}-{k}", checkpoint_dir="/ckpt/r",
        start_step=start, started_at=at(started), metrics_log=f"attempt-{k}.metrics.jsonl",
        log_dir=f"attempt-{k}/"))
    rec.update(end_step=end, last_logged_step=logged, outcome=outcome, failed_at_step=failed_at,
               error=error, lost_nodes=list(lost),
               exit_reason="running" if outcome == "running" else f"{outcome} (test)")
    if outcome != "running":
        rec["ended_at"] = at(started + 30)
    return rec


# --------------------------------------------------------------------------- crash_loop


def test_crash_loop_at_the_same_step_names_both_attempts_logs_and_error():
    recs = [record(1, "failed", 0, 20, logged=24, failed_at=25,
                   error="RuntimeError: NCCL timeout"),
            record(2, "failed", 20, 20, logged=24, failed_at=25,
                   error="RuntimeError: NCCL timeout")]
    assert crash_loop(recs, "results/r/train/attempts") == (
        "crash loop at step 25: attempts 1 and 2 failed there; see "
        "results/r/train/attempts/attempt-1/, results/r/train/attempts/attempt-2/; "
        "error: RuntimeError: NCCL timeout")
    # Any order in; without the folder, the log folders as the records name them.
    assert crash_loop(recs[::-1]).startswith(
        "crash loop at step 25: attempts 1 and 2 failed there; see attempt-1/, attempt-2/")


def test_progress_between_failures_is_no_crash_loop():
    first = record(1, "failed", 0, 20, logged=24, failed_at=25)
    # the next attempt saved step 40 before failing at the same-looking place
    assert crash_loop([first, record(2, "failed", 20, 40, logged=44, failed_at=45)]) is None
    # no new checkpoint, but it broke at another step
    assert crash_loop([first, record(2, "failed", 20, 20, logged=22, failed_at=23)]) is None
    # it did not start from the first one's checkpoint (a person moved the tracker)
    assert crash_loop([first, record(2, "failed", 10, 10, logged=24, failed_at=25)]) is None
    assert crash_loop([first]) is None
    # the same step under another configuration (a fresh start, a change resumed)
    other = {**record(2, "failed", 20, 20, logged=24, failed_at=25), "trajectory_id": "b" * 64}
    assert crash_loop([{**first, "trajectory_id": "a" * 64}, other]) is None


def test_an_early_failure_is_retried_once_and_stops_when_it_repeats():
    err = "ModuleNotFoundError: No module named 'verl'"
    first = record(1, "failed", 0, None, error=err)
    assert crash_loop([first]) is None
    msg = crash_loop([first, record(2, "failed", 0, None, error=err)], "a")
    assert msg == ("crash loop at step 1: attempts 1 and 2 failed there; see a/attempt-1/, "
                   f"a/attempt-2/; error: {err}")
    # Two different errors are both named.
    msg = crash_loop([first, record(2, "failed", 0, None, error="KeyError: 'actor'")])
    assert msg.endswith(f"; error: {err}; error: KeyError: 'actor'")
    # Resumed at step 30, verl's validation line at the resumed step is not a training step.
    assert crash_loop([record(4, "failed", 30, 30, logged=30),
                       record(5, "failed", 30, 30, logged=30)]).startswith(
        "crash loop at step 31: attempts 4 and 5")


def test_any_other_outcome_breaks_the_chain():
    crash = record(1, "failed", 0, 20, logged=24, failed_at=25)
    for between in ("stopped_for_time_limit", "time_limit", "preempted", "node_lost",
                    "succeeded", "killed"):
        mid = record(2, between, 20, 20, logged=22)
        again = record(3, "failed", 20, 20, logged=24, failed_at=25)
        assert crash_loop([crash, mid, again]) is None, between
    # A time limit stop after a save, then the same crash twice: a loop again.
    recs = [crash, record(2, "stopped_for_time_limit", 20, 30, logged=30),
            record(3, "failed", 30, 30, logged=34, failed_at=35),
            record(4, "failed", 30, 30, logged=34, failed_at=35)]
    assert crash_loop(recs).startswith("crash loop at step 35: attempts 3 and 4")


def test_hung_twice_at_the_same_step_is_a_crash_loop():
    recs = [record(1, "hung", 0, 40, logged=42, failed_at=43),
            record(2, "hung", 40, 40, logged=42, failed_at=43)]
    assert crash_loop(recs).startswith("crash loop at step 43: attempts 1 and 2")
    recs[1]["outcome"] = "node_lost"
    assert crash_loop(recs) is None


# --------------------------------------------------------------------------- decide


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(str(tmp_path / "results"), "r", str(tmp_path / "ckpt"))


def write_records(layout: Layout, *recs: dict) -> None:
    for rec in recs:
        write_json_atomic(Path(layout.attempt_record(rec["attempt"])), rec)


def write_exit(layout: Layout, *, retry: bool, reason: str, attempts: list[int],
               ended: float = 40.0, exclude: list[str] | None = None) -> None:
    """job-exit.json as hy3rl.train.write_job_exit writes it."""
    write_json_atomic(Path(layout.train_job_exit), {
        "job": "4711", "ended_at": at(ended), "attempts": attempts, "retry": retry,
        "reason": reason, "exclude": exclude or []})


def no_slurm(*args):
    raise AssertionError(f"SLURM asked: {args}")


def lines(layout: Layout) -> list[dict]:
    path = Path(layout.train_submissions)
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def test_first_submission_reads_nothing_and_asks_slurm_nothing(layout: Layout):
    write_records(layout, record(1, "failed", 0, None), record(2, "failed", 0, None))
    write_exit(layout, retry=False, reason="crash loop at step 1: ...", attempts=[2])
    Path(layout.train_submissions).write_text("not json\n")  # not even read
    assert decide(layout, 1, SINCE, job_state=no_slurm, node_state=no_slurm) == Decision()
    assert Path(layout.train_submissions).read_text() == "not json\n"


def test_job_exit_retry_false_stops_with_its_reason(layout: Layout):
    loop = ("crash loop at step 5: attempts 1 and 2 failed there; see "
            f"{layout.attempt_logs(1)}/, {layout.attempt_logs(2)}/")
    write_records(layout, record(1, "failed", 0, 0, logged=4, failed_at=5),
                  record(2, "failed", 0, 0, logged=4, failed_at=5, started=10))
    write_exit(layout, retry=False, reason=loop, attempts=[1, 2])
    d = decide(layout, 2, SINCE, job_state=no_slurm, node_state=no_slurm)
    assert d.stop == loop
    [line] = lines(layout)
    assert line.pop("at") >= SINCE
    assert line == {"snakemake_attempt": 2, "stop": loop, "exclude": [],
                    "notes": [f"job 4711 (attempts 1, 2): {loop}"], "nothing_left": False,
                    "planned": False}


def test_nodes_to_exclude_merge_and_stay_excluded(layout: Layout):
    # submission 1: attempt 1 lost gpu02 and restarted without it; attempt 2 hit the time
    # limit; the job asks to exclude gpu02.
    write_records(layout, record(1, "node_lost", 0, 10, logged=12, lost=("gpu02",)),
                  record(2, "stopped_for_time_limit", 10, 30, logged=30, started=20))
    write_exit(layout, retry=True, reason="stopped after the save of step 30",
               attempts=[1, 2], ended=25, exclude=["gpu02"])
    d = decide(layout, 2, SINCE, job_state=no_slurm, node_state=no_slurm)
    assert (d.stop, d.exclude) == (None, ["gpu02"])
    # submission 2 (excluding gpu02) loses gpu05; gpu02 stays excluded.
    write_records(layout, record(3, "node_lost", 30, 40, logged=41, started=LATER,
                                 nodes=("gpu01", "gpu05"), lost=("gpu05",)))
    write_exit(layout, retry=True, reason="ray node gpu05 died", attempts=[3],
               ended=LATER + 20, exclude=["gpu05"])
    d = decide(layout, 3, SINCE, job_state=no_slurm, node_state=no_slurm)
    assert (d.stop, d.exclude) == (None, ["gpu02", "gpu05"])
    assert d.notes == ["job 4711 (attempts 3): ray node gpu05 died"]
    assert [ln["exclude"] for ln in lines(layout)] == [["gpu02"], ["gpu02", "gpu05"]]
    assert with_exclude("--ntasks-per-node=1 --exclusive", d.exclude) == (
        "--ntasks-per-node=1 --exclusive --exclude=gpu02,gpu05")
    assert with_exclude("--exclusive", []) == "--exclusive"


def test_only_this_invocation_counts(layout: Layout):
    # A previous invocation ended in a crash loop and excluded gpu02; a person fixed the
    # cause and reran: its first job fails with progress (retry true, no job-exit of its own
    # yet is older than the controller).
    write_records(layout, record(1, "failed", 0, 0, failed_at=5, logged=4, started=-300),
                  record(2, "failed", 0, 0, failed_at=5, logged=4, started=-200,
                         lost=("gpu02",)))
    write_exit(layout, retry=False, reason="crash loop at step 5: ...", attempts=[1, 2],
               ended=-100, exclude=["gpu02"])
    Path(layout.train_submissions).write_text(json.dumps(
        {"at": at(-150), "snakemake_attempt": 2, "stop": None, "exclude": ["gpu03"],
         "notes": [], "nothing_left": False}) + "\n")
    write_records(layout, record(3, "failed", 0, 20, logged=24, failed_at=25, started=5))
    write_exit(layout, retry=True, reason="trainer failed; no restart left in this job",
               attempts=[3], ended=50)
    d = decide(layout, 2, SINCE, job_state=no_slurm, node_state=no_slurm)
    assert (d.stop, d.exclude) == (None, [])
    assert d.notes == ["job 4711 (attempts 3): trainer failed; no restart left in this job"]


def test_a_finished_segments_job_exit_is_not_the_failed_jobs(layout: Layout):
    # Segment 1 finished (its job-exit says retry false: nothing left to do); the next job
    # died on a SLURM node failure before writing its own.
    write_records(layout, record(1, "succeeded", 0, 20, logged=20),
                  record(2, "running", 20, None, started=20, job="4712"))
    write_exit(layout, retry=False, reason="finished", attempts=[1], ended=15)
    d = decide(layout, 2, SINCE, job_state=lambda j: SlurmJob("NODE_FAIL", ["gpu01", "gpu02"]),
               node_state=lambda nodes: {"gpu01": "idle", "gpu02": "down*"})
    assert (d.stop, d.exclude) == (None, ["gpu02"])
    assert d.notes == ["node failure (SLURM NODE_FAIL) on gpu02"]


def test_node_fail_without_job_exit_asks_slurm(layout: Layout):
    write_records(layout, record(1, "running", 0, None, job="4711"))
    asked: list = []

    def job_state(job_id):
        asked.append(job_id)
        return SlurmJob("NODE_FAIL", ["gpu01", "gpu02"])

    d = decide(layout, 2, SINCE, job_state=job_state, node_state=lambda nodes: {
        "gpu01": "drained", "gpu02": "allocated"})
    assert asked == ["4711"]
    assert (d.stop, d.exclude, d.notes) == (None, ["gpu01"],
                                            ["node failure (SLURM NODE_FAIL) on gpu01"])
    # The resubmission lands on gpu02 + gpu03 and meets a NODE_FAIL that sinfo cannot
    # place: the job's nodes are excluded, and gpu01 stays excluded.
    write_records(layout, record(2, "running", 0, None, job="4712", started=LATER,
                                 nodes=("gpu02", "gpu03")))
    d = decide(layout, 3, SINCE, job_state=lambda j: SlurmJob("NODE_FAIL", []),
               node_state=lambda nodes: {})
    assert d.exclude == ["gpu01", "gpu02", "gpu03"]
    assert d.notes == ["node failure (SLURM NODE_FAIL) on gpu02, gpu03 (sinfo shows none of "
                       "them down: excluding all)"]


def test_preemption_and_other_deaths_without_job_exit_resubmit(layout: Layout):
    write_records(layout, record(1, "running", 0, None, job="4711"))
    d = decide(layout, 2, SINCE, job_state=lambda j: SlurmJob("PREEMPTED", ["gpu01"]),
               node_state=no_slurm)
    assert (d.stop, d.exclude, d.notes) == (
        None, [], ["attempt 1: SLURM job 4711 was preempted; resubmitting"])
    write_records(layout, record(2, "running", 0, None, job="4712", started=LATER))
    d = decide(layout, 3, SINCE, job_state=lambda j: None, node_state=no_slurm)
    assert (d.stop, d.notes) == (None, ["attempt 2: SLURM no longer knows job 4712 (no "
                                        "job-exit.json); resubmitting"])
    # A local run (no SLURM job) killed with its record still running.
    write_records(layout, record(3, "running", 0, None, job=None, started=LATER + 5))
    d = decide(layout, 4, SINCE, job_state=no_slurm, node_state=no_slurm)
    assert d.stop is None and "ran outside SLURM" in d.notes[0]


def test_crash_loop_in_the_records_stops_without_job_exit(layout: Layout):
    # The job wrote both records but was killed before job-exit.json.
    write_records(layout, record(1, "failed", 0, 0, logged=4, failed_at=5, error="E: x"),
                  record(2, "failed", 0, 0, logged=4, failed_at=5, error="E: x", started=9))
    d = decide(layout, 2, SINCE, job_state=no_slurm, node_state=no_slurm)
    assert d.stop == (f"crash loop at step 5: attempts 1 and 2 failed there; see "
                      f"{layout.attempt_logs(1)}/, {layout.attempt_logs(2)}/; error: E: x")


def test_planned_stops_spend_no_failed_submission(layout: Layout):
    """Issue 19, 10: a time-limit stop that added a checkpoint is free; failures count
    against train.max_submissions; a time limit reached without a new checkpoint stops."""
    write_records(layout, record(1, "stopped_for_time_limit", 0, 20, logged=20))
    write_exit(layout, retry=True, reason="stopped after the save of step 20", attempts=[1])
    d = decide(layout, 2, SINCE, job_state=no_slurm, node_state=no_slurm, max_failed=1)
    assert d.stop is None and lines(layout)[-1]["planned"] is True
    assert "no failed submission" in d.notes[-1]
    # a failure of the next job: the first failed submission; max 1 -> stop
    write_records(layout, record(2, "failed", 20, 20, logged=24, failed_at=25, started=LATER))
    write_exit(layout, retry=True, reason="failed", attempts=[2], ended=LATER + 31)
    d = decide(layout, 3, SINCE, job_state=no_slurm, node_state=no_slurm, max_failed=1)
    assert d.stop == "1 failed submission(s) of this training job in this invocation " \
        "(train.max_submissions = 1)"


def test_a_time_limit_without_a_new_checkpoint_stops(layout: Layout):
    write_records(layout, record(1, "time_limit", 20, 20, logged=20))
    write_exit(layout, retry=True, reason="time limit", attempts=[1])
    d = decide(layout, 2, SINCE, job_state=no_slurm, node_state=no_slurm, max_failed=5)
    assert d.stop and d.stop.startswith("attempt 1 ended for the time limit without adding a "
                                        "checkpoint (newest complete step 20")
    # a preemption without progress counts as a failed submission, and is resubmitted
    write_records(layout, record(2, "preempted", 20, 20, started=LATER))
    write_exit(layout, retry=True, reason="preempted", attempts=[2], ended=LATER + 31)
    d = decide(layout, 3, SINCE, job_state=no_slurm, node_state=no_slurm, max_failed=5)
    assert d.stop is None and lines(layout)[-1]["planned"] is False


def test_two_jobs_that_left_nothing_stop(layout: Layout):
    d = decide(layout, 2, SINCE, job_state=no_slurm, node_state=no_slurm)
    assert d.stop is None and lines(layout)[-1]["nothing_left"] is True
    d = decide(layout, 3, SINCE, job_state=no_slurm, node_state=no_slurm)
    assert d.stop.startswith("the training job ended twice without starting a trainer "
                             "(submissions 1 and 2 left no attempt record")
    assert f"{layout.results}/logs/" in d.stop


def test_unreadable_files_are_named(layout: Layout):
    write_records(layout, record(1, "failed", 0, None))
    Path(layout.attempt_record(2)).write_text("{\"attempt\": 2, ")
    with pytest.raises(ResubmitError, match=r"attempt-2\.json: unreadable"):
        decide(layout, 2, SINCE)
    bad = record(2, "failed", 0, None)
    bad["start_step"] = "zero"
    write_records(layout, bad)
    with pytest.raises(ResubmitError, match=r"attempt-2\.json: start_step is 'zero'"):
        decide(layout, 2, SINCE)
    Path(layout.attempt_record(2)).unlink()
    write_json_atomic(Path(layout.train_job_exit), {"job": "1", "ended_at": at(5)})
    with pytest.raises(ResubmitError, match=r"job-exit\.json: bad or missing attempts, retry"):
        decide(layout, 2, SINCE)


def test_slurm_answers_parse():
    assert parse_sacct("NODE_FAIL|gpu[01-02]\n") == ("NODE_FAIL", "gpu[01-02]")
    assert parse_sacct("CANCELLED by 1000|gpu01\n") == ("CANCELLED by 1000", "gpu01")
    assert parse_sacct("") is None
    out = ("JobId=4711 JobName=hy3rl_x UserId=u(1) JobState=NODE_FAIL Reason=NodeDown "
           "ReqNodeList=(null) ExcNodeList=gpu09 NodeList=gpu[01-02] BatchHost=gpu01")
    assert parse_scontrol_job(out) == ("NODE_FAIL", "gpu[01-02]")
    assert parse_scontrol_job("") is None
    assert [s for s in ("idle", "down*", "drained", "draining", "fail", "mixed", "idle*",
                        "allocated") if node_unusable(s)] == [
        "down*", "drained", "draining", "fail", "idle*"]


# --------------------------------------------------------------------------- Snakemake


def test_slurm_profile_keeps_global_retries_zero():
    profile = yaml.safe_load((REPO_ROOT / "profiles/slurm/config.yaml").read_text())
    assert profile["retries"] == 0


def _workdir(tmp: Path, run: str, held: bool = False,
             **train) -> tuple[Path, Layout, list[str]]:
    """A working directory where training's inputs exist (preflight and deps are not
    allowed to run) and each training job fails in its first second without an attempt
    record: preflight's plan refuses the launch (the job says `retry: false` in
    job-exit.json), or, ``held``, a live process (this one) holds the checkpoint directory's
    lock, taken after the controller's `onstart:` check (skipped with --no-hooks): the job
    leaves nothing behind."""
    override = {"run": {"name": run},
                "cluster": {"gpu": True, "nodes": 1, "gpus_per_node": 1, "cpus_per_node": 1},
                "train": {"checkpoint_root": str(tmp / "ckpt"), "cpu": {"enable": False},
                          **train},
                "preflight": {"waive": ["rehearsal"]}}  # the training job alone
    layout = Layout.from_config(make_config(**override))
    work = tmp / "work"
    (work / layout.preflight_plan).parent.mkdir(parents=True)
    (work / layout.preflight_plan).write_text(json.dumps(
        {"ok": False, "errors": ["refused by tests/test_resubmit.py"]}))
    extra = []
    if held:
        ckpt = Path(layout.checkpoint_dir)
        (work / layout.preflight_plan).write_text(json.dumps(plan_json(ckpt, 4, 2, run)))
        ckpt.mkdir(parents=True)
        (ckpt / LOCK_NAME).write_text(json.dumps(dataclasses.asdict(my_lock_info(1))))
        extra = ["--no-hooks"]
    (work / layout.preflight_launch).write_text("#!/bin/sh\nexit 1\n")
    (work / layout.deps_runtime_env).parent.mkdir(parents=True)
    (work / layout.deps_runtime_env).write_text("{}\n")
    # what rule train_launch (not allowed to run here) would write
    (work / layout.train_plan).parent.mkdir(parents=True)
    shutil.copy2(work / layout.preflight_plan, work / layout.train_plan)
    shutil.copy2(work / layout.preflight_launch, work / layout.train_launch)
    cfg = tmp / "override.yaml"
    cfg.write_text(yaml.safe_dump(override))
    return work, layout, ["--configfile", str(REPO_ROOT / "config/config.yaml"), str(cfg),
                          "--cores", "1", *extra]


def _decisions(work: Path, layout: Layout) -> list[dict]:
    path = work / layout.train_submissions
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("rule", ["train", "train_segment"])
def test_snakemake_resubmits_a_training_job_max_submissions_minus_one_times(tmp_path: Path,
                                                                           rule: str):
    work, layout, args = _workdir(tmp_path, "resubmit", held=True, max_submissions=2,
                                  segment_steps=1)
    target = layout.train_done if rule == "train" else layout.segment_sentinel(1)
    if rule == "train":  # the last segment's sentinel, as if segment 1 had finished
        (work / layout.segment_sentinel(1)).parent.mkdir(parents=True)
        (work / layout.segment_sentinel(1)).write_text("{}\n")
    proc = run_snakemake([target, *args, "--allowed-rules", rule], work, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count(f"Error in rule {rule}:") == 2, out  # submitted twice, then given up
    first, second = _decisions(work, layout)
    assert (first["snakemake_attempt"], first["stop"], first["nothing_left"]) == (2, None, True)
    assert second["snakemake_attempt"] == 3 and second["stop"]
    assert "; not resubmitted" in out


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_snakemake_stops_a_bad_input_before_resubmitting(tmp_path: Path):
    """The job refuses preflight's plan: job-exit.json says a retry cannot help, and the
    controller stops before the second submission with the job's message."""
    work, layout, args = _workdir(tmp_path, "resubmit", max_submissions=5)
    proc = run_snakemake([layout.train_done, *args, "--allowed-rules", "train"], work,
                         check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("Error in rule train:") == 1, out
    assert "preflight reported errors: ['refused by tests/test_resubmit.py']; not " \
        "resubmitted" in out, out
    [line] = _decisions(work, layout)
    assert "refused by tests/test_resubmit.py" in line["stop"]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_snakemake_stops_before_the_third_job_when_two_left_nothing(tmp_path: Path):
    work, layout, args = _workdir(tmp_path, "resubmit", held=True, max_submissions=5)
    proc = run_snakemake([layout.train_done, *args, "--allowed-rules", "train"], work,
                         check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("Error in rule train:") == 2, out
    assert "the training job ended twice without starting a trainer" in out
    assert [ln["stop"] is not None for ln in _decisions(work, layout)] == [False, True]


def _crash_loop_records(work: Path, layout: Layout) -> str:
    """Two records of a crash loop dated after the controller's start (as the attempts of
    this invocation write them); returns the crash-loop message."""
    future = datetime.now(UTC) + timedelta(hours=1)
    for k in (1, 2):
        rec = record(k, "failed", 0, 0, logged=2, failed_at=3, error="RuntimeError: boom")
        rec["started_at"] = (future + timedelta(minutes=k)).isoformat(timespec="seconds")
        write_json_atomic(work / layout.attempt_record(k), rec)
    return (f"crash loop at step 3: attempts 1 and 2 failed there; see "
            f"{layout.train_attempts}/attempt-1/, {layout.train_attempts}/attempt-2/; "
            "error: RuntimeError: boom")


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_snakemake_stops_a_crash_loop_before_resubmitting(tmp_path: Path):
    work, layout, args = _workdir(tmp_path, "resubmit", max_submissions=5)
    message = _crash_loop_records(work, layout)
    proc = run_snakemake([layout.train_done, *args, "--allowed-rules", "train"], work,
                         check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("Error in rule train:") == 1, out  # the loop's job; none after it
    assert f"{message}; not resubmitted" in out, out
    assert [ln["stop"] for ln in _decisions(work, layout)] == [message]
    # an ordinary job failure (hy3rl.resubmit.Retries), not an exception that aborts the
    # scheduler and cancels the other jobs: with --keep-going the rest of the DAG goes on
    assert "InputFunctionException" not in out, out
    assert "Exiting because a job execution failed" in out, out
    state = json.loads((work / layout.train_state).read_text())
    assert state["state"] == "stopped" and state["reason"] == f"{message}; not resubmitted"


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_dry_run_and_the_jobs_own_snakemake_decide_nothing(tmp_path: Path):
    work, layout, args = _workdir(tmp_path, "resubmit", max_submissions=5)
    _crash_loop_records(work, layout)
    proc = run_snakemake(["-n", layout.train_done, *args, "--allowed-rules", "train"], work)
    assert "slurm_extra=--ntasks-per-node=1 --exclusive," in proc.stdout
    # The job side (what the SLURM executor runs on the node): exec mode remote, with the
    # job's attempt number; it runs the job (which fails on the plan) once, never retries it
    # inside the allocation (only the controller resubmits), and decides nothing.
    proc = run_snakemake([layout.train_done, *args, "--allowed-rules", "train", "--mode",
                          "remote", "--attempt", "3"], work, check=False)
    out = proc.stdout + proc.stderr
    assert out.count("Error in rule train:") == 1 and "crash loop" not in out, out
    assert "Trying to restart" not in out, out
    assert "refused by tests/test_resubmit.py" in (work / layout.log("train")).read_text()
    assert not (work / layout.train_submissions).exists()


def test_a_start_that_hangs_is_tried_on_other_nodes_before_it_is_a_loop():
    """Issue 19, 5: two startups that hung on the same nodes are no crash loop yet (the job
    ends for a new allocation); on other nodes too, they are."""
    a = record(1, "hung", 0, None, nodes=("gpu01", "gpu02"))
    b = record(2, "hung", 0, None, nodes=("gpu02", "gpu01"), started=40)
    assert crash_loop([a, b]) is None
    c = record(3, "hung", 0, None, nodes=("gpu03", "gpu04"), started=80)
    assert crash_loop([a, b, c]).startswith("crash loop at step 1: attempts 2 and 3")


def test_retries_decide_the_next_submission_when_snakemake_asks():
    """Snakemake 9.27.1 retries while `restart_times > attempt - 1`: Retries answers with
    the decision for submission attempt + 1, only while retries are left; it is an int
    everywhere else."""
    from hy3rl.resubmit import Retries

    asked: list[int] = []

    def resubmit(attempt: int) -> bool:
        asked.append(attempt)
        return attempt < 3

    r = Retries(4, resubmit)
    assert isinstance(r, int) and r == 4 and r + 1 == 5 and not r < 0
    assert (r > 1 - 1) is True and asked == [2]  # attempt 1 failed: submission 2 is made
    assert (r > 2 - 1) is False and asked == [2, 3]  # attempt 2 failed: the decision stops
    asked.clear()
    assert (r > 4) is False and asked == []  # no retry left: the decision is not asked


def test_a_start_hung_on_a_node_the_reports_named_is_no_loop():
    """Issue 44: the node agents' reports named the node that stopped first (excluded from
    the resubmission); a startup hang after it, on other nodes, is new evidence, not a
    crash loop."""
    a = record(1, "hung", 0, None, nodes=("gpu01", "gpu02", "gpu03"))
    a["timing"] = {"node_quiet_s": {"gpu01": 100.0, "gpu02": 2000.0, "gpu03": 120.0}}
    b = record(2, "hung", 0, None, nodes=("gpu01", "gpu03", "gpu04"), started=40)
    assert crash_loop([a, b]) is None
    a["timing"]["node_quiet_s"]["gpu02"] = 130.0  # no evidence: on other nodes, a loop
    assert crash_loop([a, b]).startswith("crash loop at step 1: attempts 1 and 2")


@pytest.mark.parametrize(("gpu03", "stops"), [("down*", True), ("drained", True),
                                              ("idle", False), ("mixed", False)])
def test_too_few_eligible_nodes_stop_instead_of_waiting(layout: Layout, gpu03: str,
                                                         stops: bool):
    """Issue 44: with fewer usable nodes of the job's partition outside the exclusions than
    the job needs, sbatch would queue for ever: the decision stops and says why."""
    write_records(layout, record(1, "hung", 0, None, nodes=("gpu01", "gpu02")))
    write_json_atomic(Path(layout.train_job_exit), {
        "job": "4711", "ended_at": at(40), "attempts": [1], "retry": True,
        "reason": "hung before its first step; gpu02 stopped progressing first",
        "exclude": ["gpu02"], "partition": "h20", "nodes_needed": 2})
    asked = []

    def partition_state(part: str) -> dict:
        asked.append(part)
        return {"gpu01": "idle", "gpu02": "idle", "gpu03": gpu03}

    d = decide(layout, 2, SINCE, job_state=no_slurm, node_state=no_slurm,
               partition_state=partition_state)
    assert asked == ["h20"] and d.exclude == ["gpu02"]
    if stops:
        assert d.stop == ("partition h20 has 1 eligible node(s) for a job of 2: 1 excluded "
                          "(gpu02), 1 down or drained (gpu03); a resubmission would wait "
                          "for ever (a new snakemake invocation starts without this one's "
                          "exclusions)"), d.stop
    else:
        assert d.stop is None
