"""Benchmark of the supervisor's time model (issue 19): prints figures, no pass/fail.

A simulated clock replays the paper run (upstream-facts.md: 16 x 8 GPUs, 200 steps of about
16 min, validation about 8 min every 10 steps, saves about 50 min every 20, a startup of
75-120 min), with random noise on every phase (seeded), one slow save (2.5 h, at step 100)
and real hangs (the trainer stops making progress at steps 57 and 143), inside SLURM jobs
of ``--limit-h`` hours. Each job: a startup, then steps; the supervisor is polled every
``--poll-min`` simulated minutes and decides, as in a real attempt:

- a hang (real or false): the attempt is stopped and restarted in the job from the newest
  checkpoint (a new startup); steps since that checkpoint are redone;
- a time-limit stop after a save: the job ends there, the next job starts from that save;
- no stop before the job's end: SLURM kills it; steps since the last save are lost;
- two hangs in a row at the same step are a crash loop (hy3rl.resubmit): the run stops.

Two supervisors see the same timeline: ``new`` is hy3rl.watchdog's real :class:`Monitor`
(its time model, reading a real metrics log on the simulated clock), ``old`` the formulas
of the code before issue 19, reproduced here: stall limit ``max(30 min, 3 x (slowest
timing_s/step + testing + slowest save))`` over all history, a fixed 120-min startup limit,
and a time-limit need of ``save_freq x p95(step + testing) + slowest save + margin``.

Figures per supervisor: false hangs, GPU-minutes idle per real hang (from the last progress
to the stop, x 128 GPUs), steps lost per time limit (SLURM's kills), time left unused per
planned stop (minutes between the stop and the job's end), jobs and wall time to finish.

    .venv/bin/python benchmarks/bench_supervisor.py [--seed N] [--seeds K] [--limit-h H]
                                                    [--poll-min M]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from hy3rl import watchdog as wd  # noqa: E402

MIN = 60.0
GPUS = 128
TOTAL, SAVE_FREQ, TEST_FREQ = 200, 20, 10
MARGIN = 10 * MIN
HANGS = (57, 143)
SLOW_SAVE_AT = 100


@dataclass
class Timeline:
    """The run's true durations (seconds), drawn once: the same for both supervisors."""

    seed: int
    step: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    save: dict[int, float] = field(default_factory=dict)
    startups: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        for s in range(1, TOTAL + 1):
            self.step[s] = 16 * MIN * rng.uniform(0.85, 1.2)
            self.val[s] = 8 * MIN * rng.uniform(0.85, 1.2)
            self.save[s] = (150 * MIN if s == SLOW_SAVE_AT
                            else 50 * MIN * rng.uniform(0.8, 1.3))
        self.startups = [rng.uniform(75, 120) * MIN for _ in range(100)]

    def work(self, s: int) -> tuple[float, float, float]:
        sched = wd.Schedule(SAVE_FREQ, TEST_FREQ, TOTAL)
        return (self.step[s], self.save[s] if sched.saves(s) else 0.0,
                self.val[s] if sched.validates(s) else 0.0)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Old:
    """The supervisor before issue 19 (module doc), over the same records."""

    lines: list[dict]
    started: float
    last_progress: float | None = None

    def stall(self) -> float:
        steps = [ln["data"]["timing_s/step"] + ln["data"].get("timing_s/testing", 0.0)
                 for ln in self.lines]
        saves = [ln["data"]["timing_s/save_checkpoint"] for ln in self.lines
                 if "timing_s/save_checkpoint" in ln["data"]]
        return max(30 * MIN, 3 * ((max(steps) if steps else 0) + (max(saves) if saves else 0)))

    def hung(self, now: float) -> bool:
        if self.last_progress is None:
            return now - self.started >= 120 * MIN
        return now - self.last_progress >= self.stall()

    def need(self) -> float | None:
        steps = [ln["data"]["timing_s/step"] + ln["data"].get("timing_s/testing", 0.0)
                 for ln in self.lines]
        saves = [ln["data"]["timing_s/save_checkpoint"] for ln in self.lines
                 if "timing_s/save_checkpoint" in ln["data"]]
        return SAVE_FREQ * wd.p95(steps) + (max(saves) if saves else 0) + MARGIN if steps \
            else None


@dataclass
class Figures:
    false_hangs: int = 0
    real_hang_idle_gpu_min: list[float] = field(default_factory=list)
    steps_lost_per_kill: list[int] = field(default_factory=list)
    unused_min_per_stop: list[float] = field(default_factory=list)
    jobs: int = 0
    wall_h: float = 0.0
    finished: bool = False
    crash_loop: bool = False


def run(kind: str, tl: Timeline, limit_s: float, poll_s: float, tmp: Path) -> Figures:
    fig = Figures()
    clock = Clock()
    history: list[dict] = []  # every attempt's lines
    startups: list[float] = []
    hung_startups: list[float] = []
    saved = 0
    hangs_left = set(HANGS)
    startup_i = 0
    attempt = 0
    last_hang: int | None = None  # the step of the previous attempt's hang
    sched = wd.Schedule(SAVE_FREQ, TEST_FREQ, TOTAL)
    allow = wd.Allowances(startup_s=180 * MIN, step_s=60 * MIN, validation_s=None,
                          save_s=4.1e12 / 1e9, shutdown_s=15 * MIN)
    while saved < TOTAL and fig.jobs < 60 and not fig.crash_loop:
        fig.jobs += 1
        job_end = clock.now + limit_s
        in_job = True
        while in_job and saved < TOTAL:
            attempt += 1
            metrics = tmp / f"{kind}-attempt-{attempt}.jsonl"
            metrics.write_text("")
            saves_done = {s for s in range(1, saved + 1) if sched.saves(s)}
            if kind == "new":
                mon = wd.Monitor(
                    metrics=metrics, schedule=sched,
                    model=wd.TimeModel.learn(allow, history, startups, hung_startups),
                    stall=wd.StallPolicy(None, 3.0, 30 * MIN, 360 * MIN), margin_s=MARGIN,
                    is_saved=lambda s, done=saves_done: s in done,
                    deadline=wd.Deadline(lambda end=job_end: end - clock.now, clock),
                    clock=clock, start_step=saved)
                mon.start()
            else:
                old = Old(list(history), clock.now)
            startup = tl.startups[startup_i % len(tl.startups)]
            startup_i += 1
            # (start of phase, end of phase, what ends it)
            plan: list[tuple[float, int | None]] = [(clock.now + startup, None)]
            t = plan[0][0]
            for s in range(saved + 1, TOTAL + 1):
                step, save, val = tl.work(s)
                t += step + save + val
                plan.append((t, s))
            outcome = None
            progress = clock.now
            for end, s in plan:
                real_hang = s is not None and s in hangs_left
                stop_at = math.inf if real_hang else end
                while clock.now + poll_s < min(stop_at, job_end):
                    clock.now += poll_s
                    if kind == "new":
                        req = mon.poll()
                        hung = req is not None and req.outcome == "hung"
                    else:
                        hung = old.hung(clock.now)
                    if hung:
                        if real_hang:
                            fig.real_hang_idle_gpu_min.append((clock.now - progress) / MIN * GPUS)
                            hangs_left.discard(s)
                        else:
                            fig.false_hangs += 1
                            if s is None:
                                hung_startups.append(clock.now - (progress))
                        outcome = "hung"
                        here = s if s is not None else -saved - 1
                        # hy3rl.resubmit.crash_loop: two hangs in a row at one step stop
                        fig.crash_loop = here == last_hang
                        last_hang = here
                        break
                if outcome:
                    break
                if end > job_end:  # SLURM's time limit
                    clock.now = job_end
                    last = max([x for x in range(saved, (s or saved) + 1)
                                if x == saved or sched.saves(x)])
                    fig.steps_lost_per_kill.append((s or saved) - 1 - last if s else 0)
                    outcome = "killed"
                    break
                clock.now = end
                progress = end
                if s is None:
                    startups.append(startup)
                    line = {"step": saved, "data": {"val-core/x": 0.8}}
                else:
                    step, save, val = tl.work(s)
                    data = {"timing_s/step": step + save}
                    if save:
                        data["timing_s/save_checkpoint"] = save
                        saved = s
                        saves_done.add(s)
                    if val:
                        data["timing_s/testing"] = val
                    line = {"step": s, "data": data}
                    history.append(line)
                with open(metrics, "a") as fh:
                    fh.write(json.dumps(line) + "\n")
                if kind == "new":
                    req = mon.poll()
                    if req is not None and req.outcome == "stopped_for_time_limit":
                        outcome = "stopped"
                else:
                    old.lines.append(line) if s is not None else None
                    old.last_progress = clock.now
                    need = old.need()
                    if s is not None and sched.saves(s) and s < TOTAL and need \
                            and job_end - clock.now < need:
                        outcome = "stopped"
                if outcome == "stopped":
                    fig.unused_min_per_stop.append((job_end - clock.now) / MIN)
                    break
            if outcome != "hung":
                last_hang = None
            if fig.crash_loop:
                break
            if outcome in ("stopped", "killed") or outcome is None:
                in_job = False
            elif outcome == "hung" and clock.now >= job_end:
                in_job = False
        clock.now = max(clock.now, 0.0)
    fig.finished = saved >= TOTAL
    fig.wall_h = clock.now / 3600
    return fig


def mean(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.0f}" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=19, help="the first seed")
    ap.add_argument("--seeds", type=int, default=10, help="timelines replayed (summed)")
    ap.add_argument("--limit-h", type=float, default=24.0)
    ap.add_argument("--poll-min", type=float, default=1.0)
    args = ap.parse_args()
    rows = {k: Figures() for k in ("old", "new")}
    unfinished = {k: 0 for k in rows}
    loops = {k: 0 for k in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seed, args.seed + args.seeds):
            tl = Timeline(seed)
            for k, total in rows.items():
                f = run(k, tl, args.limit_h * 3600, args.poll_min * MIN, Path(tmp))
                total.false_hangs += f.false_hangs
                total.real_hang_idle_gpu_min += f.real_hang_idle_gpu_min
                total.steps_lost_per_kill += f.steps_lost_per_kill
                total.unused_min_per_stop += f.unused_min_per_stop
                total.jobs += f.jobs
                total.wall_h += f.wall_h
                unfinished[k] += not f.finished
                loops[k] += f.crash_loop
    print(f"paper profile, {TOTAL} steps, save_freq {SAVE_FREQ}, test_freq {TEST_FREQ}, "
          f"jobs of {args.limit_h:g} h, {args.seeds} timelines (seeds {args.seed}-"
          f"{args.seed + args.seeds - 1}), real hangs at steps {HANGS} in each, a 2.5 h save "
          f"at step {SLOW_SAVE_AT}")
    print(f"{'':>36} {'old':>10} {'new':>10}")
    n = args.seeds
    for name, get in [
        ("false hangs (total)", lambda f: str(f.false_hangs)),
        (f"real hangs caught (of {len(HANGS) * n})",
         lambda f: str(len(f.real_hang_idle_gpu_min))),
        ("GPU-min idle per real hang caught", lambda f: mean(f.real_hang_idle_gpu_min)),
        ("SLURM time-limit kills (total)", lambda f: str(len(f.steps_lost_per_kill))),
        ("steps lost per kill (mean)", lambda f: mean(f.steps_lost_per_kill)),
        ("planned stops (total)", lambda f: str(len(f.unused_min_per_stop))),
        ("min left unused per stop (mean)", lambda f: mean(f.unused_min_per_stop)),
        ("jobs per run (mean)", lambda f: f"{f.jobs / n:.1f}"),
        ("wall time per run (h, mean)", lambda f: f"{f.wall_h / n:.1f}"),
    ]:
        print(f"{name:>36} {get(rows['old']):>10} {get(rows['new']):>10}")
    print(f"{'runs stopped by a crash loop':>36} {loops['old']:>10} {loops['new']:>10}")
    print(f"{'runs not finished':>36} {unfinished['old']:>10} {unfinished['new']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
