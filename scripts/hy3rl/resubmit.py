"""The controller's resubmission guard for the training rules (``train``, ``train_segment``).

Snakemake resubmits a failed training job up to ``train.max_submissions`` times (the rules'
``retries``), and re-evaluates the rules' ``slurm_extra`` resource before each submission
(``rules/common.smk``, ``train_slurm_extra``). That callable asks :func:`decide`, which
reads what the failed job left in ``train/attempts/`` and says whether a resubmission may
help (else the workflow stops with a message *before* sbatch: no GPU node is allocated
for a job that would only find the crash loop and exit) and which nodes it must avoid
(``sbatch --exclude``).

Contract (docs/formats/train.md):

- :func:`crash_loop` is the one crash-loop rule, shared by the job (before a restart in its
  allocation) and the controller: the newest two attempts both ``failed`` or ``hung``, the
  second started from the first's last complete checkpoint and saved none, and both broke
  at the same step (equal ``failed_at_step``, or neither logged a training step: an error in
  the trainer's first minutes, such as a configuration or import error, is retried once
  and stops when it repeats). Two startups that hung (no metrics line at all) on the same
  nodes are not a loop yet: the job ends for a new allocation instead of restarting in
  its own, and a loop needs the hang on other nodes too; nor is a startup hang after one
  whose node agents named the nodes that stopped first (:func:`stalled_nodes`, excluded
  from the resubmission: the next hang is new evidence). Any other outcome in between
  breaks the chain.
- An attempt the health guard stopped (outcome ``unhealthy``, hy3rl.health) is never
  resubmitted: the decision stops with its ``health_stop`` message (the rule, the step,
  the values, the last healthy checkpoint and how to go on).
- :func:`decide` for Snakemake's ``attempt`` (1 = the first submission of this job in this
  invocation). Attempt 1 reads nothing and asks SLURM nothing: the dry run and the DAG
  never touch the records or the cluster, and a person's rerun (a new invocation) is never
  refused nor restricted by what earlier invocations left. Only records started and a
  ``job-exit.json`` written after ``since`` (the controller's start) count. Attempt >= 2:
  the failed job's ``job-exit.json`` (retry false: stop with its reason; its ``exclude``
  nodes). Without one (NODE_FAIL, an OOM kill of the batch step, a kill after the
  preemption grace time), the failed job's newest record, and when that still says
  ``running``, SLURM's state of its job: NODE_FAIL excludes the nodes ``sinfo`` shows down,
  drained or failing (all of the job's nodes when none can be told). A job that left
  neither (it died before its first attempt: a broken environment, a refused input, or it
  never started) is resubmitted once; twice in a row stops. Every node lost or excluded
  earlier in this invocation stays excluded; when the failed job's partition
  (``job-exit.json`` ``partition``) has fewer usable nodes outside them than the job needs
  (:func:`too_few_nodes`), the decision stops with that reason instead of a submission
  that would wait for ever. :func:`crash_loop` over this invocation's
  records is a second guard. Each decision is one line of
  ``train/attempts/submissions.jsonl``.
- Unreadable records raise :class:`ResubmitError` naming the file (the rule turns it into a
  WorkflowError: a message, no traceback).

Times compare the controller's clock (``since``) with the jobs' clocks (records): the
cluster's hosts are assumed to be NTP-synchronised, as SLURM itself requires.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hy3rl.errors import StageError
from hy3rl.layout import ATTEMPT_RE, Layout
from hy3rl.timefmt import parse, utc_now
from hy3rl.watchdog import slurm_output

FAILED = frozenset({"failed", "hung"})
# A job that ended for the time limit or a preemption did not fail: it is resubmitted
# without spending train.max_submissions when it added a complete checkpoint.
PLANNED = frozenset({"stopped_for_time_limit", "time_limit", "preempted"})
# Snakemake's retries of a training job: max_submissions - 1 failed submissions plus at
# most this many planned ones (each must add a checkpoint: bounded by the run's saves).
PLANNED_CAP = 1000

# Types of the record keys the guard reads (other keys are not its business). Records of
# older versions lack the newer keys: a missing key reads as None / [].
_RECORD_KEYS: dict[str, tuple[type, ...]] = {
    "outcome": (str,), "exit_reason": (str,), "slurm_job_id": (str, int),
    "start_step": (int,), "end_step": (int,), "failed_at_step": (int,),
    "last_logged_step": (int,), "error": (str,), "log_dir": (str,),
    "nodes": (list,), "lost_nodes": (list,),
}


class ResubmitError(StageError):
    """A record the guard must read is unreadable; the message names the file."""


@dataclass(frozen=True)
class Decision:
    """What the controller does with submission ``attempt`` of a training job: ``stop``
    (the message to stop the workflow with; None: submit), the nodes to ``exclude`` and
    ``notes`` saying why (both also in submissions.jsonl)."""

    stop: str | None = None
    exclude: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SlurmJob:
    """SLURM's view of a job: its ``state`` (first word: ``CANCELLED by 0`` -> CANCELLED)
    and its ``nodes`` (expanded host names)."""

    state: str
    nodes: list[str]


# --------------------------------------------------------------------------- crash loop


def outcome(rec: Mapping[str, Any]) -> str | None:
    """The record's outcome; a record without one (older versions) that still says
    ``running`` is running, otherwise unknown (None)."""
    if rec.get("outcome"):
        return str(rec["outcome"])
    return "running" if rec.get("exit_reason") == "running" else None


def _no_step_logged(rec: Mapping[str, Any]) -> bool:
    """No training step in the attempt's log (verl's validation line at the resumed step
    is not one): it failed in the trainer's first minutes."""
    last = rec.get("last_logged_step")
    return last is None or last <= (rec.get("start_step") or 0)


def _loops(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Attempt ``b`` (after ``a``) repeats ``a``'s failure: see the module doc."""
    if outcome(a) not in FAILED or outcome(b) not in FAILED:
        return False
    start = b.get("start_step") or 0
    if start != (a.get("end_step") or 0) or (b.get("end_step") or 0) != start:
        return False
    fa, fb = a.get("failed_at_step"), b.get("failed_at_step")
    if startup_hang(a) and startup_hang(b) and (
            stalled_nodes(a) or (a.get("nodes")
                                 and sorted(a["nodes"]) == sorted(b.get("nodes") or []))):
        # a start that hangs is tried on other nodes before it is a loop; one that hung
        # on a node the reports named had that node excluded: the next hang is new evidence
        return False
    return (fa is not None and fa == fb) or (_no_step_logged(a) and _no_step_logged(b))


def startup_hang(rec: Mapping[str, Any]) -> bool:
    """The attempt hung before its first step (model loads, NCCL initialisation)."""
    return outcome(rec) == "hung" and rec.get("last_logged_step") is None


STALL_LEAD_S = 300.0  # a node stopped this much before the last node to progress: evidence


def node_quiet(rec: Mapping[str, Any]) -> dict[str, float]:
    """The attempt record's ``timing.node_quiet_s``: per node that reported, the seconds since
    its processes last progressed, at the stop (numbers only; empty without reports)."""
    quiet = (rec.get("timing") or {}).get("node_quiet_s")
    if not isinstance(quiet, dict):
        return {}
    return {str(n): float(v) for n, v in quiet.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def stalled_nodes(rec: Mapping[str, Any]) -> list[str]:
    """The nodes a hung startup's node agents show stopped progressing first (the attempt
    record's ``timing.node_quiet_s``: per node, the seconds since its processes last
    progressed, at the stop; hy3rl.loadwatch): those quiet :data:`STALL_LEAD_S` longer
    than the node that progressed last, when they are at most half of the nodes that
    reported (more is no evidence against any one node: the cause is elsewhere, and the
    allocation is never excluded whole), and, where the reports say which nodes had model
    shards mapped at the stop (``timing.node_loading``), only nodes still in their load (a
    node that finished a smaller share of the load first and then waited is no culprit).
    Empty without reports from two nodes or more."""
    if not startup_hang(rec):
        return []
    q = node_quiet(rec)
    if len(q) < 2:
        return []
    last = min(q.values())
    stalled = sorted(n for n, v in q.items() if v - last >= STALL_LEAD_S)
    loading = (rec.get("timing") or {}).get("node_loading")
    if isinstance(loading, list) and any(n not in loading for n in stalled):
        return []
    return stalled if 2 * len(stalled) <= len(q) else []


def crash_loop(records: Sequence[Mapping[str, Any]],
               attempts_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The crash-loop message when the newest two of ``records`` (attempt records, any
    order) form a crash loop (module doc), else None. ``attempts_dir``
    (``Layout.train_attempts``) makes the log folders in the message full paths; without
    it they are named as the records name them (relative to ``train/attempts/``)."""
    recs = sorted(records, key=lambda r: r["attempt"])
    if len(recs) < 2 or not _loops(recs[-2], recs[-1]):
        return None
    if recs[-2].get("trajectory_id") != recs[-1].get("trajectory_id"):
        return None  # another configuration (a fresh start, a change resumed): not a loop
    a, b = recs[-2], recs[-1]
    step = b.get("failed_at_step")
    if step is None:
        step = (b.get("start_step") or 0) + 1
    logs = [os.path.join(attempts_dir, r["log_dir"]) if attempts_dir else r["log_dir"]
            for r in (a, b)]
    msg = (f"crash loop at step {step}: attempts {a['attempt']} and {b['attempt']} failed "
           f"there; see {logs[0]}, {logs[1]}")
    errors = [e for e in (a.get("error"), b.get("error")) if e]
    for e in dict.fromkeys(errors):
        msg += f"; error: {e}"
    return msg


# --------------------------------------------------------------------------- reading


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ResubmitError(f"{path}: unreadable ({exc}); the resubmission guard needs it "
                            "(fix or move the file, then rerun)") from None


def _time(path: Path | str, where: str, value: Any) -> datetime:
    t = parse(value) if isinstance(value, str) else None
    if t is None:
        raise ResubmitError(f"{path}: {where} is {value!r}, not an ISO 8601 time")
    return t


def _check_record(path: Path, k: int, rec: Any) -> dict[str, Any]:
    """The record at ``path`` (``attempt-<k>.json``), its keys' types checked."""
    if not isinstance(rec, dict):
        raise ResubmitError(f"{path}: not a JSON object")
    if rec.get("attempt") != k:
        raise ResubmitError(f"{path}: attempt is {rec.get('attempt')!r}, expected {k}")
    _time(path, "started_at", rec.get("started_at"))
    for key, types in _RECORD_KEYS.items():
        value = rec.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise ResubmitError(f"{path}: {key} is {value!r}, expected "
                                f"{' or '.join(t.__name__ for t in types)}")
    for key in ("nodes", "lost_nodes"):
        if not all(isinstance(n, str) for n in rec.get(key) or []):
            raise ResubmitError(f"{path}: {key} must be a list of node names")
    if not rec.get("log_dir"):
        rec["log_dir"] = f"attempt-{k}/"
    return rec


def records_since(layout: Layout, since: datetime) -> list[dict[str, Any]]:
    """The attempt records started at or after ``since``, by attempt number."""
    folder = Path(layout.train_attempts)
    if not folder.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in folder.iterdir()
                   if (m := ATTEMPT_RE.match(p.name)))
    recs = [_check_record(p, k, _read_json(p)) for k, p in found]
    return [r for r in recs if parse(r["started_at"]) >= since]


def _check_job_exit(path: Path, doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ResubmitError(f"{path}: not a JSON object")
    _time(path, "ended_at", doc.get("ended_at"))
    checks = {
        "job": isinstance(doc.get("job"), str),
        "attempts": isinstance(doc.get("attempts"), list)
        and all(isinstance(k, int) for k in doc["attempts"]),
        "retry": isinstance(doc.get("retry"), bool),
        "reason": isinstance(doc.get("reason"), str),
        "exclude": isinstance(doc.get("exclude"), list)
        and all(isinstance(n, str) for n in doc["exclude"]),
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ResubmitError(f"{path}: bad or missing {', '.join(bad)} (docs/formats/train.md,"
                            " job-exit.json)")
    return doc


def failed_job_exit(layout: Layout, after: datetime, records: Sequence[Mapping[str, Any]],
                    ) -> tuple[dict[str, Any] | None, datetime]:
    """``job-exit.json`` if the failed job (submitted at or after ``after``) wrote it, and
    the time from which records are the failed job's. A job-exit written before ``after``
    is older; one whose last attempt ``succeeded`` is an earlier job's that finished (a
    previous segment), and one followed by another job's attempt is stale (that job died
    without writing its own): the failed job started after either."""
    path = Path(layout.train_job_exit)
    if not path.exists():
        return None, after
    doc = _check_job_exit(path, _read_json(path))
    ended = parse(doc["ended_at"])
    if ended < after:
        return None, after
    newest = max(doc["attempts"], default=None)
    last = next((r for r in records if r["attempt"] == newest), None)
    later = any(r["attempt"] not in doc["attempts"] and parse(r["started_at"]) >= ended
                for r in records)
    if later or (last is not None and outcome(last) == "succeeded"):
        return None, ended
    return doc, after


def decisions_since(layout: Layout, since: datetime) -> list[dict[str, Any]]:
    """The lines of ``submissions.jsonl`` written at or after ``since``, oldest first."""
    path = Path(layout.train_submissions)
    if not path.exists():
        return []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ResubmitError(f"{path}: unreadable ({exc})") from None
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and isinstance(row.get("exclude"), list)
        except ValueError:
            ok = False
        if not ok:
            raise ResubmitError(f"{path}: line {i} is not a decision (fix or remove it)")
        if _time(path, f"line {i}: at", row.get("at")) >= since:
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- SLURM


def hostnames(nodelist: str) -> list[str]:
    """A SLURM node list (``n[1-3],m1``) as host names (``scontrol show hostnames``); kept
    as one entry, which ``--exclude`` also accepts, when scontrol cannot expand it."""
    nodelist = nodelist.strip()
    if not nodelist or nodelist in ("None assigned", "(null)"):
        return []
    out = slurm_output(["scontrol", "show", "hostnames", nodelist])
    names = out.split() if out else []
    return names or [nodelist]


def parse_sacct(out: str) -> tuple[str, str] | None:
    """(State, NodeList) from the first line of ``sacct -X -n -P -o State,NodeList``."""
    line = next((ln for ln in out.splitlines() if ln.strip()), "")
    state, _, nodelist = line.partition("|")
    return (state.strip(), nodelist.strip()) if state.strip() else None


def parse_scontrol_job(out: str) -> tuple[str, str] | None:
    """(JobState, NodeList) from ``scontrol show job -o`` (one ``key=value`` line)."""
    fields = dict(t.split("=", 1) for t in out.split() if "=" in t)
    state = fields.get("JobState", "")
    return (state, fields.get("NodeList", "")) if state else None


def slurm_job(job_id: str) -> SlurmJob | None:
    """The job's state and nodes: ``sacct`` (knows finished jobs where accounting is on),
    else ``scontrol show job`` (jobs still in the controller's memory); None when neither
    knows it."""
    found = parse_sacct(slurm_output(["sacct", "-X", "-n", "-P", "-j", job_id,
                                      "-o", "State,NodeList"]) or "")
    found = found or parse_scontrol_job(
        slurm_output(["scontrol", "show", "job", "-o", job_id]) or "")
    if found is None:
        return None
    state, nodelist = found
    return SlurmJob(state.split()[0], hostnames(nodelist))


def slurm_node_states(nodes: Sequence[str]) -> dict[str, str]:
    """``{node: state}`` from ``sinfo -N`` (``idle``, ``down*``, ``drained``, ...); empty
    when sinfo cannot tell."""
    if not nodes:
        return {}
    return _sinfo_states(["-n", ",".join(nodes)])


def _sinfo_states(select: list[str]) -> dict[str, str]:
    """``{node: state}`` of the nodes ``sinfo -N`` selects with ``select``."""
    out = slurm_output(["sinfo", "-h", "-N", *select, "-o", "%N %T"])
    states: dict[str, str] = {}
    for line in (out or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def partition_node_states(partition: str) -> dict[str, str]:
    """``{node: state}`` of every node of ``partition`` (``sinfo -N -p``); empty when sinfo
    cannot tell."""
    return _sinfo_states(["-p", partition])


def too_few_nodes(job_exit: Mapping[str, Any], exclude: Sequence[str],
                  partition_state: Callable[[str], Mapping[str, str]]) -> str | None:
    """Why a resubmission cannot be placed: fewer usable nodes of the job's partition
    (``job-exit.json`` ``partition``, ``nodes_needed``) outside ``exclude`` than the job
    needs; None when they are enough or it cannot be told."""
    part, need = job_exit.get("partition"), job_exit.get("nodes_needed")
    if not exclude or not isinstance(part, str) or not part or not isinstance(need, int):
        return None
    states = partition_state(part)
    if not states:
        return None
    out = set(exclude)
    usable = sorted(n for n, st in states.items() if n not in out and not node_unusable(st))
    if len(usable) >= need:
        return None
    down = sorted(n for n, st in states.items() if n not in out and node_unusable(st))
    return (f"partition {part} has {len(usable)} eligible node(s) for a job of {need}: "
            f"{len(out & set(states))} excluded ({', '.join(sorted(out & set(states)))})"
            + (f", {len(down)} down or drained ({', '.join(down)})" if down else "")
            + "; a resubmission would wait for ever (a new snakemake invocation starts "
              "without this one's exclusions)")


def node_unusable(state: str | None) -> bool:
    """A node SLURM shows down, drained or failing, or not responding (``*``)."""
    s = (state or "").lower()
    return any(w in s for w in ("down", "drain", "fail")) or s.endswith("*")


# --------------------------------------------------------------------------- decision


def _from_record(rec: Mapping[str, Any],
                 job_state: Callable[[str], SlurmJob | None],
                 node_state: Callable[[Sequence[str]], Mapping[str, str]],
                 ) -> tuple[list[str], list[str]]:
    """Notes and nodes to exclude when the failed job wrote no job-exit.json, from its
    newest record ``rec``, and SLURM's state of its job when ``rec`` is still running."""
    k, out = rec["attempt"], outcome(rec)
    if out != "running":
        return [f"attempt {k} ended {out or 'without an outcome'} ({rec.get('exit_reason')})"
                " but its job wrote no job-exit.json; resubmitting"], []
    job_id = rec.get("slurm_job_id")
    if not job_id:
        return [f"attempt {k} is still marked running and ran outside SLURM: its process "
                "was killed; resubmitting"], []
    job = job_state(str(job_id))
    if job is None:
        return [f"attempt {k}: SLURM no longer knows job {job_id} (no job-exit.json); "
                "resubmitting"], []
    if job.state == "NODE_FAIL":
        nodes = job.nodes or list(rec.get("nodes") or [])
        states = node_state(nodes)
        bad = [n for n in nodes if node_unusable(states.get(n))]
        how = "" if bad else " (sinfo shows none of them down: excluding all)"
        bad = bad or nodes
        return [f"node failure (SLURM NODE_FAIL) on {', '.join(bad) or 'unknown nodes'}"
                f"{how}"], bad
    if job.state == "PREEMPTED":
        return [f"attempt {k}: SLURM job {job_id} was preempted; resubmitting"], []
    return [f"attempt {k}: SLURM job {job_id} ended {job.state} without writing "
            "job-exit.json; resubmitting"], []


def planned(job_records: Sequence[Mapping[str, Any]]) -> tuple[bool, str | None]:
    """Whether the failed job (its attempt records, oldest first) ended as planned: its
    last attempt stopped for the time limit or was preempted, and the job added a complete
    checkpoint. Returns (planned, stop): ``stop`` says why a time-limit job that added no
    checkpoint must not be resubmitted (it would meet the same limit at the same step)."""
    if not job_records:
        return False, None
    last = job_records[-1]
    if outcome(last) not in PLANNED:
        return False, None
    first = int(job_records[0].get("start_step") or 0)
    end = max(int(r.get("end_step") or 0) for r in job_records)
    if end > first:
        return True, None
    if outcome(last) == "preempted":
        return False, None  # counts as a failed submission
    return False, (f"attempt {last['attempt']} ended for the time limit without adding a "
                   f"checkpoint (newest complete step {end}, as when the job started): the "
                   "time limit does not hold a startup and one save interval; raise "
                   "cluster.train_time_min or lower SAVE_FREQ")


def decide(layout: Layout, attempt: int, since: str, *,
           job_state: Callable[[str], SlurmJob | None] = slurm_job,
           node_state: Callable[[Sequence[str]], Mapping[str, str]] = slurm_node_states,
           partition_state: Callable[[str], Mapping[str, str]] = partition_node_states,
           max_failed: int | None = None) -> Decision:
    """The decision for Snakemake's submission ``attempt`` of a training job of the run in
    ``layout``, ``since`` being the controller's start (module doc). The first submission
    is stopped only for a resume the records already refuse (hy3rl.train.sick_resume).
    ``job_state`` and ``node_state`` ask SLURM (:func:`slurm_job`,
    :func:`slurm_node_states`). Attempt >= 2 appends the decision to ``submissions.jsonl``.
    ``max_failed``
    (``train.max_submissions``): the failed submissions of this job allowed in this
    invocation; a job that ended as planned (:func:`planned`) is not one. Raises
    :class:`ResubmitError` for an unreadable record."""
    if attempt < 2:
        # the first submission: refused only when the records already decide it (a resume
        # from a checkpoint a health stop rule calls sick), before any allocation
        from hy3rl.train import sick_resume

        return Decision(sick_resume(layout))
    start = parse(since)
    if start is None:
        raise ResubmitError(f"the controller's start time {since!r} is not an ISO 8601 time")
    records = records_since(layout, start)
    decisions = decisions_since(layout, start)
    # The failed job was submitted after this job's previous decision (attempt >= 3; the
    # jobs of the training rules run one after another), or at some time in this invocation.
    previous = decisions[-1] if decisions and decisions[-1].get(
        "snakemake_attempt") == attempt - 1 else None
    after = parse(previous["at"]) if previous else start
    job_exit, after = failed_job_exit(layout, after, records)
    mine = [r for r in records if parse(r["started_at"]) >= after]
    exclude = [str(n) for d in decisions for n in d["exclude"]]
    exclude += [n for r in records for n in r.get("lost_nodes") or []]
    stop, notes = None, []
    if job_exit is not None:
        notes.append(f"job {job_exit['job']} (attempts "
                     f"{', '.join(map(str, job_exit['attempts'])) or 'none'}): "
                     f"{job_exit['reason']}")
        exclude += job_exit["exclude"]
        if not job_exit["retry"]:
            stop = job_exit["reason"] or f"job {job_exit['job']} ended with retry false"
    elif mine:
        more, nodes = _from_record(mine[-1], job_state, node_state)
        notes += more
        exclude += nodes
    else:
        notes.append("the failed job left no attempt record and no job-exit.json: it ended "
                     "before starting a trainer, or never started")
        if previous is not None and previous.get("nothing_left"):
            stop = (f"the training job ended twice without starting a trainer (submissions "
                    f"{attempt - 2} and {attempt - 1} left no attempt record and no "
                    f"job-exit.json); see its log under {Path(layout.log('train')).parent}/ "
                    "and its SLURM log")
    loop = crash_loop(records, layout.train_attempts)
    if stop is None and loop:
        stop = loop
    if stop is None and job_exit is not None:
        stop = too_few_nodes(job_exit, sorted(set(exclude)), partition_state)
    sick = next((r for r in reversed(mine) if outcome(r) == "unhealthy"), None)
    if stop is None and sick is not None:  # the health guard stopped it: never resubmitted
        health = sick.get("health_stop")
        message = health.get("message") if isinstance(health, dict) else None
        stop = str(message or f"attempt {sick['attempt']} was stopped by the health guard "
                   "(unhealthy)")
    free, no_progress = planned(sorted(mine, key=lambda r: r["attempt"]))
    if free:
        notes.append("the job ended as planned and added a checkpoint: no failed submission")
    elif stop is None and no_progress:
        stop = no_progress
    # This job's earlier decisions: its submissions 2 .. attempt-1 (the training jobs run
    # one after another, so they are the newest lines).
    earlier = decisions[max(0, len(decisions) - (attempt - 2)):] if attempt > 2 else []
    failed = sum(1 for d in earlier if not d.get("planned")) + (0 if free else 1)
    if stop is None and max_failed is not None and failed >= max_failed:
        stop = (f"{failed} failed submission(s) of this training job in this invocation "
                f"(train.max_submissions = {max_failed})")
    decision = Decision(stop, sorted(set(exclude)), notes)
    append_decision(layout, attempt, decision, nothing_left=job_exit is None and not mine,
                    planned=free)
    return decision


def append_decision(layout: Layout, attempt: int, decision: Decision, *,
                    nothing_left: bool, planned: bool = False) -> None:
    """One line ``{"at", "snakemake_attempt", "stop", "exclude", "notes", "nothing_left",
    "planned"}``
    appended to ``submissions.jsonl`` (``nothing_left``: the failed job left no record and
    no job-exit.json; twice in a row stops). hy3rl.atomic has no append helper (it
    replaces whole files): one short line in one write in append mode (O_APPEND: never
    interleaved), flushed and fsync'ed, is the durable equivalent for a log that grows."""
    path = Path(layout.train_submissions)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"at": utc_now(), "snakemake_attempt": attempt, "stop": decision.stop,
                       "exclude": decision.exclude, "notes": decision.notes,
                       "nothing_left": nothing_left, "planned": planned})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def with_exclude(slurm_extra: str, exclude: Sequence[str]) -> str:
    """``slurm_extra`` plus ``--exclude=<nodes>`` (last: sbatch keeps the last --exclude,
    so it replaces the one snakemake-executor-plugin-slurm adds after a NODE_FAIL, which
    names every node of the failed job)."""
    return f"{slurm_extra} --exclude={','.join(exclude)}" if exclude else slurm_extra


class Retries(int):
    """``retries`` of the training rules that decides each resubmission when Snakemake asks
    for it. Snakemake 9.27.1 retries a failed job while ``rule.restart_times > attempt - 1``
    (``JobScheduler._handle_error``, its one use of it); this int answers that comparison with
    ``resubmit(attempt)`` (the submission it would make), so that a stop is an ordinary job
    failure: with ``--keep-going`` the rest of the DAG goes on, without it the workflow
    waits for its running jobs and stops cleanly. (A WorkflowError raised from the job's
    resources instead aborts the scheduler at once, even with --keep-going, and cancels the
    other jobs.) Every other use is a plain int."""

    def __new__(cls, value: int, resubmit: Callable[[int], bool]) -> Retries:
        obj = super().__new__(cls, value)
        obj.resubmit = resubmit
        return obj

    def __gt__(self, restarts: object) -> bool:
        # ``restarts`` = attempt - 1 of the job that failed: the next submission is
        # attempt + 1 = restarts + 2.
        if not isinstance(restarts, int):
            return NotImplemented
        if int(self) <= restarts:
            return False
        return bool(self.resubmit(restarts + 2))
