"""Benchmark of the supervisor's time model (issues 19, 29): prints figures, no pass/fail.

A simulated clock drives the real :class:`hy3rl.watchdog.Monitor` (its :class:`TimeModel`,
:class:`Deadline`, phase and silence limits) through the paper run's profile
(upstream-facts.md: 200 steps of about 16 min, validation about 8 min every 10 steps, a
save of about 50 min every 20, a startup of 75-120 min, 16 x 8 GPUs) inside SLURM jobs of
``--limit-h`` hours. The trainer is simulated on disk as the launcher sees it: its output
(``driver.log``: a line every 0.5-15 min in every phase, verl's save line as a save
starts; verl prints none as a validation starts), its metrics lines (verl's file logger,
with ``timing_s/step``, ``timing_s/save_checkpoint``, ``timing_s/testing``) and the
checkpoint being written (``global_step_<N>/`` growing every minute of a save, complete at
its end). The monitor is polled every ``--poll-min`` simulated minutes.

An attempt ends as the monitor says: hung (restarted in the job from the newest checkpoint,
with a new startup), stopped for the time limit after a save (the next job starts from it),
or killed by SLURM at the job's end (steps since the last save lost). Startups measured are
fed to the next attempt's model, hung startups never are.

Reported:

- **paper profile** (no noise): false hangs, time-limit stops and their unused hours.
- **noisy runs** (``--runs``, default 1,000): each phase +-20 %, startups 75-200 min, one
  run in ten with one save of 2.5 h: false hangs, SLURM kills, unused hours at each
  time-limit stop (median, max).
- **hangs**, each case of issue 29's table on the paper profile: the trainer stops in a
  phase (at 5 %, 50 % and 95 % of it) and the time to detection is measured (max): a hang
  that goes quiet (no output: a collective blocked on every rank), and one that keeps
  printing (only the phase limits and the checkpoint bytes can tell); issue 44's saves: one
  hung after verl's save line before its first byte, and one whose bytes trickle (4 MB
  every 5-44 min after the hang).
- **five startup hangs** on the same nodes: idle GPU-hours until each is declared hung,
  and the attempt after which ``hy3rl.train.after_attempt`` excludes the nodes.

    .venv/bin/python benchmarks/bench_supervisor.py [--runs N] [--seed S] [--limit-h H]
                                                    [--poll-min M] [--jobs J]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from hy3rl import watchdog as wd  # noqa: E402

MIN = 60.0
GPUS = 128
OUTAGE_STATUS_S = 30.0  # the launcher's status checks during an outage (3 x its 10-s timeout)
OUTAGE = (2, 2 * MIN, 62 * MIN)  # a 60-min outage early in the second attempt's startup
TOTAL, SAVE_FREQ, TEST_FREQ = 200, 20, 10
PAPER = wd.Schedule(SAVE_FREQ, TEST_FREQ, TOTAL)
MARGIN = 10 * MIN
SILENCE = 45 * MIN  # train.watchdog.silence_min's default
# the checkpoint's bytes on disk are its real size x BYTE_SCALE (sparse files)
CKPT_BYTES, BYTE_SCALE = 4e12, 1e-6
ALLOW = wd.Allowances(startup_s=180 * MIN, step_s=60 * MIN, validation_s=None,
                      save_s=4.1e12 / 1e9, shutdown_s=15 * MIN,  # 4.1 TB at 1 GB/s
                      startup_floor_s=200 * MIN, startup_cap_s=360 * MIN,  # the defaults
                      first_byte_s=15 * MIN, save_rate_b_s=1e9 * BYTE_SCALE)
TRICKLE_GAP = (5 * MIN, 44 * MIN)  # a trickling save: a write of TRICKLE_BYTES this often
TRICKLE_BYTES = 4e6
STALL = wd.StallPolicy(None, 2.0, 30 * MIN, 360 * MIN)  # train.watchdog's defaults
LOG_GAP = (0.5 * MIN, 15 * MIN)
# verl@220e903's v1 trainer as a save starts (trainer_base.py:720, verl's logging format,
# Ray's prefix); it prints nothing as a validation starts (hy3rl.watchdog.SAVE_LINE)
SAVE_LINE = ("(TaskRunnerV1 pid=4242) INFO:2026-12-05 10:00:00,000:Saving checkpoint to "
             "/ckpt/global_step_{}")


# verl@220e903's v1 trainer's startup lines (hy3rl.watchdog.STARTUP_MARKS), as the driver log
# shows them, at the end of the sub-phase each names. The sub-phases' shares of a startup are
# an assumption (no sub-phase figures of the paper run are published; the first run's
# attempt records, timing.startup_marks, will give them): the Megatron load and the vLLM
# servers most of it, the checkpoint load and the validation before training the rest.
V1 = "(TaskRunnerV1 pid=4242) INFO:2026-12-05 10:00:00,000:"
STARTUP_SHARES = (("datasets", 0.03, "Total training steps: 200"),
                  ("workers", 0.05, "create worker group dict_keys(['actor_rollout'])"),
                  ("actor_model", 0.35, "actor and ref model engine initialized"),
                  ("rollout", 0.30, "checkpoint engine manager initialized"),
                  ("checkpoint", 0.17, "all initialize finished, ready to fit"),
                  ("validation", 0.10, None))  # ends at the first metrics line


def startup_marks(length: float, noise: float, rng: random.Random) -> list[tuple[str, float,
                                                                                  str | None]]:
    """The sub-phases of a startup of ``length`` seconds: (name, seconds from the submission
    to its end, its line), each share +-``noise`` (renormalised to the length)."""
    ws = [w * rng.uniform(1 - noise, 1 + noise) for _, w, _ in STARTUP_SHARES]
    k, at, out = length / sum(ws), 0.0, []
    for (name, _, text), w in zip(STARTUP_SHARES, ws, strict=True):
        at += w * k
        out.append((name, at, text))
    return out


@dataclass
class Profile:
    """The run's true durations (seconds): per step, per save, per validation; startups
    in the order the attempts meet them."""

    step: dict[int, float]
    val: dict[int, float]
    save: dict[int, float]
    startups: list[float]
    seed: int = 0
    share_noise: float = 0.0  # each startup sub-phase's share +- this

    @classmethod
    def paper(cls) -> Profile:
        return cls({s: 16 * MIN for s in range(1, TOTAL + 1)},
                   {s: 8 * MIN for s in range(1, TOTAL + 1)},
                   {s: 50 * MIN for s in range(1, TOTAL + 1)}, [100 * MIN] * 50)

    @classmethod
    def noisy(cls, seed: int) -> Profile:
        rng = random.Random(seed)
        p = cls({s: 16 * MIN * rng.uniform(0.8, 1.2) for s in range(1, TOTAL + 1)},
                {s: 8 * MIN * rng.uniform(0.8, 1.2) for s in range(1, TOTAL + 1)},
                {s: 50 * MIN * rng.uniform(0.8, 1.2) for s in range(1, TOTAL + 1)},
                [rng.uniform(75, 200) * MIN for _ in range(50)], seed, 0.2)
        if seed % 10 == 0:  # one run in ten: one save of 2.5 h
            p.save[rng.choice(range(SAVE_FREQ, TOTAL, SAVE_FREQ))] = 150 * MIN
        return p


@dataclass(frozen=True)
class Hang:
    """The trainer stops in ``phase`` (startup, step, save, validation) of ``step`` (a
    startup: of ``attempt``) at ``frac`` of it; ``noisy``: its output goes on; ``trickle``:
    a save's bytes go on, :data:`TRICKLE_BYTES` every :data:`TRICKLE_GAP`."""

    phase: str
    step: int = 0
    frac: float = 0.5
    noisy: bool = False
    attempts: tuple[int, ...] = ()
    trickle: bool = False  # a save: its bytes go on, a small write every 5-44 min


@dataclass
class Result:
    false_hangs: int = 0
    false_why: list[str] = field(default_factory=list)  # the watchdog's message of each
    detections: list[tuple[str, float]] = field(default_factory=list)  # (phase, s)
    unused_s: list[float] = field(default_factory=list)  # per time-limit stop
    reserve_s: list[float] = field(default_factory=list)  # those reserving for a slow save
    kills: int = 0
    steps_lost: int = 0
    jobs: int = 0
    attempts: int = 0
    saved: int = 0
    startup_hang_waits: list[float] = field(default_factory=list)
    # after each startup hang: the nodes hy3rl.train.after_attempt excludes
    excluded: list[list[str]] = field(default_factory=list)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def line(p: Profile, s: int) -> dict:
    """verl's metrics line of step ``s`` under the profile (the save inside timing_s/step)."""
    data = {"timing_s/step": p.step[s] + (p.save[s] if PAPER.saves(s) else 0.0)}
    if PAPER.saves(s):
        data["timing_s/save_checkpoint"] = p.save[s]
    if PAPER.validates(s):
        data["timing_s/testing"] = p.val[s]
    return {"step": s, "data": data}


def events(p: Profile, start_step: int, t0: float, startup: float, hang: Hang | None,
           attempt: int, rng: random.Random) -> Iterator[tuple[float, str, object]]:
    """The attempt's trainer as the launcher sees it, in time order: ("log", text),
    ("bytes", (step, fraction)), ("saved", step), ("line", record); after a hang, only
    output (a noisy hang) or nothing."""
    def phase(t: float, length: float, name: str, step: int, marker: str | None):
        """Output through a phase; bytes in a save. Yields events; returns nothing."""
        if marker:
            yield t, "log", marker
        if name == "save":
            for k in range(1, int(length // MIN) + 1):
                yield t + k * MIN, "bytes", (step, k * MIN / length)
        g = t + rng.uniform(*LOG_GAP)
        while g < t + length:
            yield g, "log", f"({name}) progress"
            g += rng.uniform(*LOG_GAP)

    def hung_at(t: float, onset: float, length: float, step: int):
        """After the hang: nothing, or its output (noisy), or its trickling bytes."""
        yield onset, "hang", None
        outs = []
        if hang.noisy:
            outs.append(noisy_output(onset))
        if hang.trickle:
            # from the last minute's bytes written before the hang
            outs.append(trickle(onset, step, (math.ceil((onset - t) / MIN) - 1) * MIN / length))
        yield from heapq.merge(*outs, key=lambda ev: ev[0])

    def noisy_output(onset: float):
        g = onset
        while True:
            g += rng.uniform(*LOG_GAP)
            yield g, "log", "(noisy) warning"

    def trickle(onset: float, step: int, frac: float):
        g = onset
        while True:
            g += rng.uniform(*TRICKLE_GAP)
            frac += TRICKLE_BYTES / CKPT_BYTES
            yield g, "bytes", (step, frac)

    def cut(gen, t: float, length: float, name: str, step: int):
        if hang and hang.phase == name and (hang.step == step if name != "startup"
                                              else attempt in hang.attempts):
            onset = t + hang.frac * length
            for ev in gen:
                if ev[0] >= onset:
                    break
                yield ev
            yield from hung_at(t, onset, length, step)
            return True
        yield from gen
        return False

    def startup_phase(t: float):
        """Output through the startup, verl's line at the end of each sub-phase."""
        begin = t
        for _name, end, text in startup_marks(startup, p.share_noise, rng):
            g = begin + rng.uniform(*LOG_GAP)
            while g < t + end:
                yield g, "log", "(startup) progress"
                g += rng.uniform(*LOG_GAP)
            if text:
                yield t + end, "log", V1 + text
            begin = t + end

    t = t0
    if (yield from cut(startup_phase(t), t, startup, "startup", start_step)):
        return
    t += startup
    yield t, "line", {"step": start_step, "data": {"val-core/x": 0.8}}
    for s in range(start_step + 1, TOTAL + 1):
        if (yield from cut(phase(t, p.step[s], "step", s, None), t, p.step[s], "step", s)):
            return
        t += p.step[s]
        if PAPER.saves(s):
            marker = SAVE_LINE.format(s)
            if (yield from cut(phase(t, p.save[s], "save", s, marker), t, p.save[s], "save", s)):
                return
            t += p.save[s]
            yield t, "saved", s
        if PAPER.validates(s):
            if (yield from cut(phase(t, p.val[s], "validation", s, None), t, p.val[s],
                               "validation", s)):
                return
            t += p.val[s]
        yield t, "line", line(p, s)


def run(p: Profile, tmp: Path, limit_s: float, poll_s: float, hang: Hang | None = None,
        start: int = 0, until: int = TOTAL, stop_on_hang: bool = False,
        outage: tuple[int, float, float] | None = None,
        on_stop: Callable[[str], object] | None = None, agents: bool = False) -> Result:
    """The run (jobs, attempts) on the simulated clock from the save of step ``start``
    (steps 1..``start`` and one startup learned as the profile has them) until the save of
    step ``until`` (or the first hang detected, ``stop_on_hang``); see the module doc.
    ``outage``: (attempt, from_s, to_s): the dashboard does not answer from ``from_s`` to
    ``to_s`` after that attempt's submission: the trainer's output reaches driver.log only
    when it answers again, and the launcher calls Monitor.blind at each unanswered status
    (every :data:`OUTAGE_STATUS_S`). ``on_stop``: called with each stop's message.
    ``agents``: the node agents report (hy3rl.loadwatch) at each poll, one file a node of
    :data:`NODES`: every node progresses until a hang; at a startup hang :data:`CULPRIT`
    stops at once and the others :data:`WAIT_S` later (they wait for it in a collective).
    After each startup hang, hy3rl.train.after_attempt decides which nodes to exclude."""
    res = Result()
    clock = Clock()
    rng = random.Random(p.seed * 7919 + 1)
    history: list[dict] = [line(p, s) for s in range(1, start + 1)]
    startups: list[float] = [p.startups[-1]] if start else []
    marks: list[dict[str, float]] = (
        [{n: at for n, at, _ in startup_marks(p.startups[-1], 0.0, rng)}] if start else [])
    # the saves before ``start`` as the monitor would have seen them write: the first byte a
    # minute after the start (the first walk), then evenly to the end
    saves: list[dict] = [{"first_byte_s": MIN, "gap_s": MIN,
                          "rate_b_s": CKPT_BYTES * BYTE_SCALE / p.save[s]}
                         for s in range(1, start + 1) if PAPER.saves(s)]
    saved = start
    hang_left = hang
    while saved < until and res.jobs < 40 and not (stop_on_hang and res.detections):
        res.jobs += 1
        job_end = clock.now + limit_s
        while saved < until and clock.now < job_end and not (stop_on_hang and res.detections):
            res.attempts += 1
            d = tmp / f"attempt-{res.attempts}"
            ckpt = d / "ckpt"
            ckpt.mkdir(parents=True)
            metrics, driver = d / "metrics.jsonl", d / "driver.log"
            metrics.write_text("")
            driver.write_text("")
            done = {s for s in range(1, saved + 1) if PAPER.saves(s)}
            mon = wd.Monitor(
                metrics=metrics, schedule=PAPER,
                model=wd.TimeModel.learn(ALLOW, history, startups, startup_marks=marks,
                                         save_marks=saves),
                stall=STALL, margin_s=MARGIN, is_saved=lambda s, done=done: s in done,
                deadline=wd.Deadline(lambda end=job_end: end - clock.now, clock),
                ckpt_dir=ckpt, start_step=saved, clock=clock, logs=[driver],
                silence_s=SILENCE)
            if agents:
                mon.progress_dir = d / "progress"
                mon.progress_dir.mkdir()
            mon.start()
            startup = p.startups[(res.attempts - 1) % len(p.startups)]
            evs = events(p, saved, clock.now, startup, hang_left, res.attempts, rng)
            nxt = next(evs, None)
            onset = None
            outcome = None
            held: list[str] = []  # output the dashboard's outage keeps from driver.log
            down = ((mon.started + outage[1], mon.started + outage[2])
                    if outage and outage[0] == res.attempts else None)
            while outcome is None:
                t = clock.now + poll_s
                if t >= job_end:  # SLURM's time limit
                    res.kills += 1
                    res.steps_lost += max(0, (mon.last_step or saved) - saved)
                    clock.now = job_end
                    outcome = "killed"
                    break
                while nxt is not None and nxt[0] <= t:
                    at, kind, what = nxt
                    if kind == "hang":
                        onset = at
                    elif kind == "log":
                        if down and down[0] <= at < down[1]:
                            held.append(what)
                        else:
                            with open(driver, "a") as fh:
                                fh.write(f"{what}\n")
                    elif kind == "bytes":
                        step, frac = what
                        f = ckpt / f"global_step_{step}" / "shard"
                        f.parent.mkdir(exist_ok=True)
                        with open(f, "a") as fh:
                            fh.truncate(int(frac * CKPT_BYTES * BYTE_SCALE))  # sparse: it grows
                    elif kind == "saved":
                        done.add(what)
                        saved = what
                    elif kind == "line":
                        if what["step"] > 0 and what["data"].get("timing_s/step"):
                            history.append(what)
                        with open(metrics, "a") as fh:
                            fh.write(json.dumps(what) + "\n")
                    nxt = next(evs, None)
                if down and clock.now < down[1] and t > down[0]:
                    u = max(clock.now, down[0])
                    while u < min(t, down[1]):  # the launcher's unanswered statuses
                        clock.now = u
                        mon.blind()
                        u += OUTAGE_STATUS_S
                    if t >= down[1] and held:  # it answers: the stream replays the output
                        with open(driver, "a") as fh:
                            fh.write("".join(f"{x}\n" for x in held))
                        held = []
                clock.now = t
                if agents and mon.first_line_at is None:  # read in the startup only
                    report(mon.progress_dir, t, onset)
                req = mon.poll()
                if req is None:
                    if (nxt is None and onset is None and mon.last_step == TOTAL) \
                            or saved >= until:
                        outcome = "finished"
                    continue
                if on_stop is not None:
                    on_stop(req.message)
                if req.outcome == "hung":
                    if onset is None:
                        res.false_hangs += 1
                        res.false_why.append(req.message)
                    else:
                        res.detections.append((mon.phase or "startup", t - onset))
                        if req.step is None:
                            res.startup_hang_waits.append(t - mon.started)
                            res.excluded.append(excluded_after(res.attempts, mon))
                        if hang_left.phase != "startup":
                            hang_left = None
                    outcome = "hung"
                elif req.outcome == "stopped_for_time_limit":
                    (res.reserve_s if "slow save" in req.message
                     else res.unused_s).append(job_end - t)
                    outcome = "stopped"
                    clock.now = job_end  # the next job starts when this one would end
                elif req.outcome == "succeeded":
                    outcome = "finished"
            if mon.startup_s is not None:  # a successful startup; a hung one never counts
                startups.append(mon.startup_s)
                marks.append(mon.timing()["startup_marks"])
            saves.extend(mon.timing()["saves"])  # a hung attempt's complete saves too
            if outcome in ("stopped", "killed"):
                break
    res.saved = saved
    return res


NODES = [f"n{i:02d}" for i in range(1, 17)]  # the paper run's 16 nodes
CULPRIT, WAIT_S = "n07", 10 * MIN


def report(progress: Path, t: float, onset: float | None) -> None:
    """Each node agent's report at ``t`` (hy3rl.loadwatch's form) as the module doc says."""
    for node in NODES:
        last = t if onset is None else min(t, onset + (0 if node == CULPRIT else WAIT_S))
        (progress / f"{node}.json").write_text(json.dumps(
            {"node": node, "t": t, "last_progress": last, "shards": [f"{node}.safetensors"]}))


def excluded_after(k: int, mon: wd.Monitor) -> list[str]:
    """What hy3rl.train.after_attempt excludes after startup hang ``k`` of one job."""
    from hy3rl.train import after_attempt

    rec = {"attempt": k, "outcome": "hung", "exit_reason": "hung before its first step",
           "last_logged_step": None, "start_step": 0, "end_step": 0, "nodes": NODES,
           "trajectory_id": "t", "log_dir": f"attempt-{k}", "timing": mon.timing()}
    return after_attempt(rec, [rec], restarts_left=3, lost=[], allocation=NODES,
                         nodes_needed=len(NODES), time_left=None, interval=None).exclude


def _run(args: tuple) -> Result:
    kind, seed, limit_s, poll_s, hang, *rest = args
    outage, agents = (rest + [None, False])[:2]
    p = Profile.paper() if kind == "paper" else Profile.noisy(seed)
    with tempfile.TemporaryDirectory() as tmp:
        return run(p, Path(tmp), limit_s, poll_s, hang, outage=outage, agents=agents)


HANG_CASES = {
    "plain step (step 57)": [Hang("step", 57)],
    "step with validation (step 50: rollout, validation)": [Hang("step", 50),
                                                            Hang("validation", 50)],
    "save step (step 60: rollout, save, validation)": [Hang("step", 60), Hang("save", 60),
                                                       Hang("validation", 60)],
    "first save, first validation (steps 20, 10)": [Hang("save", 20), Hang("validation", 10)],
    "save before its first byte (step 60; first save: 20)": [Hang("save", 60, 0.01),
                                                             Hang("save", 20, 0.01)],
    "save trickling a write every 5-44 min (step 60; 20)": [Hang("save", 60, trickle=True),
                                                            Hang("save", 20, trickle=True)],
    "startup, not the first (attempts 2-6)": [Hang("startup", attempts=(2, 3, 4, 5, 6))],
    "first startup": [Hang("startup", attempts=(1,))],
}
# a hang inside the model load (just after verl's worker-group line, halfway, near its end:
# the paper profile's shares), without and with the node agents reporting its progress
# (run(agents)); and the whole startups with the agents (their exclusions)
LOAD_FRACS = (0.081, 0.255, 0.42)
LOAD_CASES = {"model load, not the first startup (attempt 2)": [Hang("startup", attempts=(2,))],
              "model load, first startup": [Hang("startup", attempts=(1,))]}
AGENT_CASES = {"model load, not the first startup, node agents":
               [Hang("startup", attempts=(2,))],
               "model load, first startup, node agents": [Hang("startup", attempts=(1,))],
               "startup, not the first, node agents (attempts 2-6)":
               [Hang("startup", attempts=(2, 3, 4, 5, 6))]}
FRACS = (0.05, 0.5, 0.95)  # where in its phase a hang starts
# and, for a startup, right after each mark (the paper profile's shares): a hang as its
# sub-phase starts waits that sub-phase's whole limit, the worst case
STARTS = tuple(round(sum(w for _, w, _ in STARTUP_SHARES[:k]) + 0.001, 3)
               for k in range(1, len(STARTUP_SHARES)))
SLOW_CASES = {"save step after one 2.5 h save (step 120)": [Hang("step", 120),
                                                              Hang("save", 120),
                                                              Hang("validation", 120)]}


def hour_fmt(xs: list[float]) -> str:
    return (f"{statistics.median(xs) / 3600:.1f} / {max(xs) / 3600:.1f}" if xs else "-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1000, help="noisy runs")
    ap.add_argument("--seed", type=int, default=0, help="the first noisy run's seed")
    ap.add_argument("--limit-h", type=float, default=24.0, help="the SLURM jobs' time limit")
    ap.add_argument("--poll-min", type=float, default=1.0, help="polls of the hang cases")
    ap.add_argument("--noisy-poll-min", type=float, default=5.0,
                    help="polls of the noisy runs (their phases are far from their limits)")
    ap.add_argument("--jobs", type=int, default=2, help="processes")
    a = ap.parse_args()
    limit, poll = a.limit_h * 3600, a.poll_min * MIN
    with ProcessPoolExecutor(a.jobs) as pool:
        paper = pool.submit(_run, ("paper", 0, limit, poll, None))
        noisy = list(pool.map(_run, [("noisy", a.seed + i, limit, a.noisy_poll_min * MIN, None)
                                     for i in range(a.runs)], chunksize=8))
        cases = {}
        for name, hangs in {**HANG_CASES, **LOAD_CASES, **AGENT_CASES, **SLOW_CASES}.items():
            for noisy_hang in (False, True):
                jobs = []
                for h in hangs:
                    fracs = ((h.frac,) if h.frac < FRACS[0]  # hung before its first byte
                             else LOAD_FRACS if "model load" in name
                             else FRACS + (STARTS if h.phase == "startup" else ()))
                    for frac in fracs:
                        hh = Hang(h.phase, h.step, frac, noisy_hang, h.attempts, h.trickle)
                        jobs.append(pool.submit(_slow if name in SLOW_CASES else _run,
                                                ("paper", 0, limit, poll, hh, None,
                                                 name in AGENT_CASES)))
                cases[name, noisy_hang] = [j.result() for j in jobs]
        outages = list(pool.map(_run, [("noisy", a.seed + i, limit, a.noisy_poll_min * MIN,
                                         None, OUTAGE) for i in range(min(a.runs, 200))],
                                chunksize=8))
        paper = paper.result()
    print(f"paper profile ({TOTAL} steps, save_freq {SAVE_FREQ}, test_freq {TEST_FREQ}), "
          f"jobs of {a.limit_h:g} h, polls every {a.poll_min:g} min (noisy runs: "
          f"{a.noisy_poll_min:g}), silence limit "
          f"{SILENCE / MIN:g} min, stall factor {STALL.factor:g}")
    print(f"  paper profile: false hangs {paper.false_hangs}, SLURM kills {paper.kills}, "
          f"time-limit stops {len(paper.unused_s)} + {len(paper.reserve_s)} reserving for a "
          f"slow save, unused h per stop (median / max) "
          f"{hour_fmt(paper.unused_s + paper.reserve_s)}, jobs {paper.jobs}")
    unused = [u for r in noisy for u in r.unused_s]
    reserve = [u for r in noisy for u in r.reserve_s]
    print(f"  {a.runs} noisy runs (phases +-20 %, startups 75-200 min, one 2.5 h save in "
          f"ten runs): false hangs {sum(r.false_hangs for r in noisy)}, SLURM kills "
          f"{sum(r.kills for r in noisy)} ({sum(r.steps_lost for r in noisy)} steps lost), "
          f"runs not finished {sum(r.saved < TOTAL for r in noisy)}")
    print(f"    time-limit stops: {len(unused)} where the next save did not fit, unused h "
          f"(median / max) {hour_fmt(unused)}; {len(reserve)} reserving for a slow save as "
          f"the job's last, unused h {hour_fmt(reserve)}")
    print(f"  a {(OUTAGE[2] - OUTAGE[1]) / MIN:.0f}-min dashboard outage from minute "
          f"{OUTAGE[1] / MIN:.0f} of attempt {OUTAGE[0]}'s startup (the output unseen, "
          f"Monitor.blind every {OUTAGE_STATUS_S:g} s), {len(outages)} noisy runs: false hangs "
          f"{sum(r.false_hangs for r in outages)}, runs not finished "
          f"{sum(r.saved < TOTAL for r in outages)}")
    print("  detection, minutes from the hang to the stop (max over the hang at 5/50/95 % of "
          "its phase;\n    a startup's also just after each of its marks):")
    print(f"    {'where the trainer hangs':<55} {'quiet':>7} {'printing':>9}")
    print("    (a model load's: just after verl's worker-group line, halfway, near its end)")
    for name in {**HANG_CASES, **LOAD_CASES, **AGENT_CASES, **SLOW_CASES}:
        row = []
        for noisy_hang in (False, True):
            ds = [d for r in cases[name, noisy_hang] for _, d in r.detections]
            missed = sum(not r.detections for r in cases[name, noisy_hang])
            row.append(f"{max(ds) / MIN:.0f}" + (f" ({missed} missed)" if missed else "")
                       if ds else "missed")
        print(f"    {name:<55} {row[0]:>7} {row[1]:>9}")
    for name in ("startup, not the first (attempts 2-6)",
                 "startup, not the first, node agents (attempts 2-6)"):
        for noisy_hang in (False, True):
            r = cases[name, noisy_hang][1]  # the hangs at half the startup
            waits = r.startup_hang_waits
            excl = [", ".join(e) or "none" for e in r.excluded]
            whole = sum(len(e) >= len(NODES) for e in r.excluded)
            print(f"  five startup hangs ({'printing' if noisy_hang else 'quiet'}, attempts "
                  f"2-6, at half the startup{', node agents' if 'agents' in name else ''}): "
                  f"{sum(waits) / 3600 * GPUS:.0f} idle GPU-hours (submission to stop: "
                  f"{', '.join(f'{w / MIN:.0f}' for w in waits)} min x {GPUS} GPUs); "
                  f"hy3rl.train.after_attempt excluded after each: {'; '.join(excl)} "
                  f"(the whole allocation {whole} times)")
    return 0


def _slow(args: tuple) -> Result:
    """A hang after one 2.5 h save (step 100)."""
    kind, seed, limit_s, poll_s, hang, *_ = args
    p = Profile.paper()
    p.save[100] = 150 * MIN
    with tempfile.TemporaryDirectory() as tmp:
        return run(p, Path(tmp), limit_s, poll_s, hang)


if __name__ == "__main__":
    sys.exit(main())
