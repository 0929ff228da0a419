"""The training-health guard (hy3rl.health): each rule on metric sequences that cross and do
not cross it, resumes, non-finite values, last_healthy, the schema's refusals, and no alarm
on the published curves nor on a normal trainer-double run."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hy3rl import config as cfgmod
from hy3rl.health import Watcher, last_healthy, metric_value, validation_se, watch
from hy3rl.settings import Config, Health
from hy3rl.verl_log import read_metrics

REPO = Path(__file__).resolve().parents[1]
BASE = cfgmod.load(REPO / "config/config.yaml")
PAPER = cfgmod.load(REPO / "config/config.yaml", REPO / "config/paper.yaml")
OFF = {name: {"action": "ignore"} for name in (
    "nonfinite", "drift", "entropy", "response_length", "clip_ratio", "reward_floor",
    "reward_fall", "validation")}


def health(base: dict = BASE, only: bool = True, **rules: dict) -> Health:
    """``train.health`` of ``base`` with ``rules`` merged in; with ``only`` every other rule
    is ignored (so a test sees the events of its rule alone)."""
    cfg = copy.deepcopy(base)
    section = cfg["train"].setdefault("health", {})
    for name, over in ({**OFF, **rules} if only else rules).items():
        section[name] = {**section.get(name, {}), **over}
    return Config.from_dict(cfg).train.health


def recs(key: str, values, start: int = 1) -> list[dict]:
    """One record a step from ``start``; None leaves the key out of that step."""
    return [{"step": start + i, "data": {} if v is None else {key: v}}
            for i, v in enumerate(values)]


def fired(h: Health, records) -> list[tuple[str, int, int]]:
    return [(e.rule, e.step, e.first_step) for e in watch(h, records)]


# --------------------------------------------------------------------------- values


def test_metric_values_nan_inf_as_floats_or_strings():
    assert metric_value(0.5) == 0.5 and metric_value(3) == 3.0
    for raw in (float("nan"), "nan", "NaN", " nan "):
        assert math.isnan(metric_value(raw))
    assert metric_value("inf") == math.inf and metric_value("-Infinity") == -math.inf
    assert metric_value(True) is None and metric_value("n/a") is None
    assert metric_value(None) is None and metric_value([1]) is None
    # verl's file logger writes JSON NaN; the reader keeps it a float
    line = json.dumps({"step": 3, "data": {"actor/grad_norm": float("nan")}})
    assert "NaN" in line and math.isnan(json.loads(line)["data"]["actor/grad_norm"])


# --------------------------------------------------------------------------- each rule


@pytest.mark.parametrize("bad", [float("nan"), "nan", "NaN", float("inf"), "-inf"])
def test_nonfinite_stops_at_once_on_float_or_string(bad):
    h = health(nonfinite={"action": "stop"})
    seq = [{"step": 1, "data": {"actor/pg_loss": 0.1, "actor/grad_norm": 0.3}},
           {"step": 2, "data": {"actor/pg_loss": 0.1, "actor/grad_norm": bad}},
           {"step": 3, "data": {"actor/pg_loss": 0.1, "actor/grad_norm": 0.3}}]
    events = watch(h, seq)
    assert [(e.rule, e.action, e.step, e.metric) for e in events] == [
        ("nonfinite", "stop", 2, "actor/grad_norm")]
    msg = events[0].message
    assert "nonfinite" in msg and "step 2" in msg and "actor/grad_norm" in msg
    assert str(metric_value(bad)) in msg
    assert json.loads(json.dumps(events[0].values)) == [[2, str(metric_value(bad))]]


def test_nonfinite_ignores_finite_and_unwatched_metrics():
    h = health(nonfinite={"action": "stop"})
    assert fired(h, [{"step": 1, "data": {"actor/pg_loss": 1e30, "actor/entropy": "nan",
                                          "training/rollout_probs_diff_mean": "nan"}}]) == []


def test_drift_fires_on_the_nth_consecutive_step_only():
    h = health(drift={"action": "stop", "max": 0.02, "steps": 3})
    key = "training/rollout_probs_diff_mean"
    # 2 above, back under, 3 above: fires at the third of the second run (window edge)
    seq = recs(key, [0.03, 0.03, 0.01, 0.03, 0.03, 0.03, 0.03])
    assert fired(h, seq) == [("drift", 6, 4)]
    # exactly at the bound is not above it; one step short of the run does not fire
    assert fired(h, recs(key, [0.02] * 5)) == []
    assert fired(h, recs(key, [0.03, 0.03])) == []
    # a run that ends and forms again fires again
    assert fired(h, recs(key, [0.03] * 3 + [0.0] + [0.03] * 3)) == [
        ("drift", 3, 1), ("drift", 7, 5)]


def test_missing_and_nan_values_neither_count_nor_reset():
    """A step without the metric (or with verl's NaN for an empty batch) is skipped: the run
    goes on across it, and it does not break the run either."""
    h = health(drift={"action": "warn", "max": 0.02, "steps": 3})
    key = "training/rollout_probs_diff_mean"
    assert fired(h, recs(key, [0.03, None, "nan", 0.03, float("nan"), 0.03])) == [
        ("drift", 6, 1)]
    assert fired(h, recs(key, [0.03, None, None, None, 0.03])) == []
    # a gap in the steps (steps never logged) does not break the run
    seq = recs(key, [0.03, 0.03]) + recs(key, [0.03], start=9)
    assert fired(h, seq) == [("drift", 9, 1)]


def test_clip_ratio_above_for_n_steps():
    h = health(clip_ratio={"action": "warn", "max": 0.2, "steps": 2})
    key = "response_length/clip_ratio"
    assert fired(h, recs(key, [0.1, 0.3, 0.1, 0.3, 0.25])) == [("clip_ratio", 5, 4)]
    assert fired(h, recs(key, [0.2, 0.2, 0.19])) == []


def test_entropy_floor():
    h = health(entropy={"action": "warn", "floor": 0.1, "steps": 2, "max_fall": None})
    assert fired(h, recs("actor/entropy", [0.5, 0.09, 0.2, 0.05, 0.08])) == [
        ("entropy", 5, 4)]
    assert fired(h, recs("actor/entropy", [0.1, 0.1, 0.1])) == []


def test_entropy_fall_over_a_window():
    h = health(entropy={"action": "warn", "floor": None, "max_fall": 0.5, "window": 3,
                        "max_rise": None})
    # windows (1, 1, 1) then (0.6, 0.5, 0.3): mean 0.467 < 0.5 x 1 fires at step 6
    assert fired(h, recs("actor/entropy", [1, 1, 1, 0.6, 0.5, 0.3])) == [("entropy", 6, 4)]
    # mean exactly half is not a fall beyond it; fewer than two windows never fires
    assert fired(h, recs("actor/entropy", [1, 1, 1, 0.5, 0.5, 0.5])) == []
    assert fired(h, recs("actor/entropy", [1, 1, 1, 0.1, 0.1])) == []
    # the slow fall of a normal run (10% over the run) never fires
    assert fired(h, recs("actor/entropy", list(np.linspace(0.5, 0.45, 100)))) == []
    # while the fall lasts it fired once; it fires again only after recovering
    seq = recs("actor/entropy", [1, 1, 1, 0.3, 0.3, 0.3, 0.3, 1, 1, 1, 1, 1, 1, 0.3, 0.3, 0.3])
    assert fired(h, seq) == [("entropy", 6, 4), ("entropy", 16, 14)]


def test_response_length_against_the_early_baseline():
    h = health(response_length={"action": "warn", "baseline_steps": 2, "min_ratio": 0.25,
                                "max_ratio": 4, "steps": 2})
    key = "response_length/mean"
    # baseline 1000 (steps 1-2); 300 and 250 are inside, 240 and 200 below a quarter
    assert fired(h, recs(key, [1000, 1000, 300, 250, 240, 200])) == [
        ("response_length", 6, 5)]
    events = watch(h, recs(key, [1000, 1000, 4001, 5000]))
    assert [(e.step, e.reference) for e in events] == [(4, 1000.0)]
    assert "baseline 1000" in events[0].message
    # before the baseline exists nothing is judged, even a collapse
    assert fired(h, recs(key, [1000, 10])) == []


def test_reward_stuck_at_its_minimum():
    h = health(reward_floor={"action": "stop", "minimum": -1, "steps": 3})
    key = "critic/score/mean"
    assert fired(h, recs(key, [0.2, -1, -1.2, -1])) == [("reward_floor", 4, 2)]
    assert fired(h, recs(key, [-1, -1, -0.99, -1, -1])) == []


def test_validation_k_standard_errors_below_the_best():
    h = health(validation={"action": "warn", "k": 3, "responses": 960, "validations": 1,
                           "metric": "val-core/math_dapo/acc/mean@1"})
    key = "val-core/math_dapo/acc/mean@1"
    se = validation_se(0.88, 0.80, 960)
    assert se == pytest.approx(math.sqrt((0.88 * 0.12 + 0.8 * 0.2) / 960))
    # 0.88 best; 0.84 is 2.4 SE below (no), 0.80 is 4.9 SE below (fires)
    events = watch(h, recs(key, [0.84, None, 0.88, None, 0.84, None, 0.80], start=0))
    assert [(e.step, e.reference) for e in events] == [(6, 0.88)]
    assert "best 0.88 (step 2)" in events[0].message
    # the published dip (0.84 -> 0.81) and end (0.88 -> 0.86), as config/paper.yaml says
    assert 0.03 / validation_se(0.84, 0.81, 960) == pytest.approx(1.73, abs=0.01)
    assert 0.02 / validation_se(0.88, 0.86, 960) == pytest.approx(1.30, abs=0.01)

    # once an episode: a fall that lasts warns once, again only after it came back
    seq = recs(key, [0.88, 0.80, 0.79, 0.80, 0.88, 0.79, 0.78])
    assert [e.step for e in watch(h, seq)] == [2, 6]
    # two validations in a row (the default): one low validation alone warns nothing
    h2 = health(validation={"action": "warn", "k": 4, "responses": 960,
                            "metric": "val-core/math_dapo/acc/mean@1"})
    assert h2.validation.validations == 2
    assert watch(h2, recs(key, [0.88, 0.78, 0.88, 0.88])) == []
    events = watch(h2, recs(key, [0.88, 0.78, 0.78, 0.77, 0.78]))
    assert [(e.step, e.first_step) for e in events] == [(3, 2)], events
    assert "in 2 validations in a row" in events[0].message


def test_off_rules_never_fire():
    h = health()  # every rule ignored
    seq = [{"step": 1, "data": {"actor/grad_norm": "nan", "critic/score/mean": -1,
                                "training/rollout_probs_diff_mean": 1.0}}] * 1
    assert fired(h, seq * 1) == []


# --------------------------------------------------------------------------- resumes


def test_a_resume_drops_the_steps_after_it_and_rebuilds_the_state():
    h = health(drift={"action": "stop", "max": 0.02, "steps": 3})
    key = "training/rollout_probs_diff_mean"
    w = Watcher(h)
    for r in recs(key, [0.01, 0.03, 0.03, 0.03, 0.03]):  # fires at 4 (run 2-4)
        w.feed(r)
    assert [(e.step, e.first_step) for e in w.events] == [(4, 2)]
    # resumed from the checkpoint at step 2: steps 3.. are logged again, healthy now
    assert w.feed({"step": 3, "data": {key: 0.01}}) == []
    assert w.events == [] and sorted(w.records) == [1, 2, 3]
    assert w.feed({"step": 4, "data": {key: 0.03}}) == []
    # the kept step 2 still counts towards a run
    w2 = Watcher(h)
    for r in recs(key, [0.01, 0.03, 0.03, 0.01]):
        w2.feed(r)
    new = w2.feed({"step": 4, "data": {key: 0.03}})  # step 4 again, now above
    assert [(e.step, e.first_step) for e in new] == [(4, 2)]


def test_a_repeated_step_returns_only_new_events_and_validation_lines_merge():
    key = "val-core/math_dapo/acc/mean@32"
    h = health(nonfinite={"action": "stop"},
               validation={"action": "warn", "k": 1, "responses": 100, "metric": key,
                           "validations": 1})
    w = Watcher(h)
    w.feed({"step": 1, "data": {key: 0.9}})
    first = w.feed({"step": 2, "data": {"actor/grad_norm": "nan"}})
    assert [e.rule for e in first] == ["nonfinite"]
    # the same line again: nothing new is returned, the event stays
    assert w.feed({"step": 2, "data": {"actor/grad_norm": "nan"}}) == []
    assert [e.step for e in w.events] == [2]
    # verl validates the resumed step before training: a val-only line joins the step
    new = w.feed({"step": 2, "data": {key: 0.5}})
    assert [e.rule for e in new] == ["validation"]
    assert w.records[2] == {"actor/grad_norm": "nan", key: 0.5}
    assert sorted(e.rule for e in w.events) == ["nonfinite", "validation"]


def test_merged_attempt_logs_fed_in_order_give_the_same_events(tmp_path: Path):
    """The launcher replays the lineage's merged logs, then the new attempt's lines: the
    events are those of the merged sequence."""
    h = health(drift={"action": "stop", "max": 0.02, "steps": 2})
    key = "training/rollout_probs_diff_mean"
    first = tmp_path / "attempt-1.metrics.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in recs(key, [0.01, 0.03, 0.01, 0.03])))
    w = Watcher(h)
    for r in read_metrics(first):
        w.feed(r)
    assert w.events == []
    for r in recs(key, [0.03, 0.03], start=3):  # attempt 2 resumed from step 2
        w.feed(r)
    assert [(e.step, e.first_step) for e in w.events] == [(3, 2)]


# --------------------------------------------------------------------------- last_healthy


class _Lines:
    """What Guard reads of the watchdog's Monitor: its lines, its own poll (nothing)."""

    def __init__(self) -> None:
        self.lines: list[dict] = []
        self.last_step = None

    def poll(self):
        return None


def test_a_nan_stops_at_once_while_another_stop_waits_for_its_save():
    """Issue 41: drift fires at step 3 (a stop that waits for the save of step 4); verl's
    file logger then writes step 4's NaN policy loss as null: the guard stops at once, not
    after the save (which would hold NaN weights), and names both events."""
    from hy3rl.health import Guard

    h = health(drift={"action": "stop", "steps": 2, "when": "next_save"},
               nonfinite={"action": "stop", "metrics": ["actor/pg_loss"]})
    events = []
    monitor = _Lines()
    guard = Guard(Watcher(h), monitor, on_event=events.append,
                  next_save=lambda s: s + (s % 2), is_saved=lambda s: False)
    drift = "training/rollout_probs_diff_mean"
    for step, (d, loss) in enumerate([(0.001, 0.1), (0.5, 0.1), (0.5, 0.1), (0.5, None)],
                                     start=1):
        monitor.lines.append(json.loads(json.dumps({"step": step, "data": {
            drift: d, "actor/pg_loss": loss}})))
        monitor.last_step = step
        request = guard.poll()
        if step == 3:
            assert request is None and guard.pending.rule == "drift"  # waits for save 4
    assert request is not None and request.outcome == "unhealthy", request
    assert "stopped at once (a non-finite value)" in request.message, request.message
    assert (guard.stop.rule, guard.stop.step, guard.stopped_after_save) == ("nonfinite", 4,
                                                                           None)
    assert [(e.rule, e.step) for e in events] == [("drift", 3), ("nonfinite", 4)]
    # without the NaN, the drift stop still waits for its save
    quiet = _Lines()
    guard = Guard(Watcher(h), quiet, on_event=lambda e: None,
                  next_save=lambda s: s + (s % 2), is_saved=lambda s: False)
    for step in range(1, 5):
        quiet.lines.append({"step": step, "data": {drift: 0.5 if step > 1 else 0.0}})
        assert guard.poll() is None


def test_the_checkpoint_a_metric_describes_rollout_side_or_after_the_update():
    """Issue 41: a rollout-side metric at step f describes checkpoint f-1; the update's loss
    and gradient norm, and the validation after the save, describe checkpoint f. A collapse
    of the reward from step 7 with saves every 2 steps names checkpoint 4 (6 generated step
    7), a NaN loss at step 7 names 6."""
    from hy3rl.health import describes_checkpoint

    for key in ("critic/score/mean", "actor/entropy", "response_length/mean",
                "response_length/clip_ratio", "training/rollout_probs_diff_mean"):
        assert describes_checkpoint(key, 7) == 6, key
    for key in ("actor/pg_loss", "actor/grad_norm", "val-core/math_dapo/acc/mean@32"):
        assert describes_checkpoint(key, 7) == 7, key
    h = health(reward_floor={"action": "stop", "minimum": -1, "steps": 2},
               nonfinite={"action": "stop", "metrics": ["actor/pg_loss"]})
    seq = [{"step": s, "data": {"critic/score/mean": -1.0 if s >= 7 else 0.5,
                                "actor/pg_loss": 0.1}} for s in range(1, 9)]
    events = watch(h, seq)
    assert [(e.rule, e.first_step) for e in events] == [("reward_floor", 7)]
    assert last_healthy([2, 4, 6, 8], events) == 4
    seq[6]["data"]["actor/pg_loss"] = None  # verl's file logger: NaN written as null
    seq[6]["data"]["critic/score/mean"] = 0.5
    seq[7]["data"]["critic/score/mean"] = 0.5
    events = watch(h, [json.loads(json.dumps(r)) for r in seq])
    assert [(e.rule, e.first_step) for e in events] == [("nonfinite", 7)]
    assert last_healthy([2, 4, 6, 8], events) == 6


def test_last_healthy_is_the_newest_checkpoint_before_the_first_stop():
    h = health(drift={"action": "stop", "max": 0.02, "steps": 3},
               clip_ratio={"action": "warn", "max": 0.2, "steps": 1})
    seq = [{"step": s, "data": {"training/rollout_probs_diff_mean": d,
                                "response_length/clip_ratio": c}}
           for s, d, c in [(1, 0.01, 0.5), (2, 0.01, 0.0), (3, 0.01, 0.0), (4, 0.03, 0.0),
                           (5, 0.03, 0.0), (6, 0.03, 0.0), (7, 0.03, 0.0)]]
    events = watch(h, seq)
    assert [(e.rule, e.action, e.step, e.first_step) for e in events] == [
        ("clip_ratio", "warn", 1, 1), ("drift", "stop", 6, 4)]
    # the checkpoint at step 4 was saved inside the run that fired: not healthy; nor is 3:
    # step 4 generated with its weights (verl's v1 trainer), so the drift at step 4 is
    # checkpoint 3's (naming it, a rewind to 3 drifts again at step 4: issue 41's loop)
    assert last_healthy([2, 4, 6], events) == 2
    assert last_healthy([3, 4], events) is None and last_healthy([2, 3], events) == 2
    assert last_healthy([4, 6], events) is None
    assert last_healthy([], events) is None
    # warn events do not count; no event: the newest
    assert last_healthy([2, 4, 6], [e for e in events if e.action == "warn"]) == 6
    assert last_healthy([6, 2, 4], []) == 6


# --------------------------------------------------------------------------- verl's keys


def fake_verl_tree(tmp_path: Path, replace: dict[str, str] | None = None) -> Path:
    """The fake verl clone's files (tests/fixtures/fake_verl.py), some replaced (by path)."""
    from fixtures.verl import fake_verl_files

    root = tmp_path / "verl"
    for rel, text in {**fake_verl_files(), **(replace or {})}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_metric_problems_read_the_pinned_clone(tmp_path: Path):
    from fixtures.fake_verl import METRIC_SOURCES_HEAD
    from hy3rl.health import VERL_METRICS, metric_problems, verl_metric

    paper = Config.from_dict(PAPER).train.health
    assert metric_problems(paper, fake_verl_tree(tmp_path), True) == []
    # a metric needing the rollout's log-probs, without them
    assert metric_problems(paper, fake_verl_tree(tmp_path), False) == [
        "train.health.drift.metric: 'training/rollout_probs_diff_mean' is logged only with "
        "actor_rollout_ref.rollout.calculate_log_probs=True (composed: False)"]
    # a clone whose metric_utils.py no longer writes response_length/clip_ratio
    old = fake_verl_tree(tmp_path / "old", {"verl/trainer/ppo/metric_utils.py": (
        METRIC_SOURCES_HEAD + '_ = {"critic/score/mean": value}\n'
        '_ = {"response_length/mean": value}\nmetric = {f"mean@{n_resps}": 1.0}\n')})
    assert metric_problems(paper, old, True) == [
        "train.health.clip_ratio.metric: 'response_length/clip_ratio' is not logged by the "
        f"pinned verl at {old}: verl/trainer/ppo/metric_utils.py does not hold "
        "'\"response_length/clip_ratio\":' (where verl@220e903 logs it)"]
    # a file the clone lacks altogether
    (old / "verl/utils/debug/metrics.py").unlink()
    assert "verl/utils/debug/metrics.py does not hold" in metric_problems(paper, old, True)[0]
    # templated keys: any data source and n, nothing else
    assert verl_metric("val-core/aime2025/acc/mean@32").key == \
        "val-core/<data_source>/<variable>/mean@<n>"
    assert verl_metric("val-core/aime2025/acc/maj@32") is None
    assert verl_metric("val-core/a/b/c/mean@1") is None
    assert len({m.key for m in VERL_METRICS}) == len(VERL_METRICS)


def test_metric_problems_hold_at_the_pin_and_name_what_the_composed_config_switches_off(
        real_verl: Path):
    """Issue 41: every key the paper's rules watch is logged by the pinned verl's own files
    (the v1 trainer main_ppo runs, not the legacy ray_trainer.py); under
    algorithm.rollout_correction.bypass_mode the v1 trainer logs neither actor/entropy nor
    training/rollout_probs_diff_*, and the rules over them are refused by name; a
    validation key is refused for a data source the validation set lacks and for an n other
    than the responses per prompt verl generates (it logs mean@<that n> only)."""
    from hy3rl.health import BYPASS_MODE, VAL_N, metric_problems

    paper = Config.from_dict(PAPER).train.health
    ok = dict(val_sources=["math_dapo"], val_n=1)
    assert metric_problems(paper, real_verl, True, **ok) == []
    # the texts the proofs cite are the v1 trainer's
    v1 = (real_verl / "verl/trainer/ppo/v1/trainer_base.py").read_text()
    assert '"actor/entropy": entropy_agg' in v1 and 'metric_sec = "val-core"' in v1
    off = metric_problems(paper, real_verl, True, bypass_mode=True, **ok)
    assert [m.split(":")[0] for m in off] == ["train.health.drift.metric",
                                             "train.health.entropy.metric"], off
    assert all(f"{BYPASS_MODE}=True" in m for m in off)
    assert "'actor/entropy' is not logged" in off[1]
    wrong = metric_problems(paper, real_verl, True, val_sources=["aime2024"], val_n=32)
    assert wrong == [
        "train.health.validation.metric: 'val-core/math_dapo/acc/mean@1' names data source "
        "'math_dapo', which the validation set does not hold (data summary: aime2024): verl "
        "logs val-core/<data_source>/... per data source of the validation rows",
        "train.health.validation.metric: 'val-core/math_dapo/acc/mean@1' asks for mean@1, "
        f"but the validation generates 32 response(s) per prompt ({VAL_N} composed 32): verl "
        "logs mean@32 only; use val-core/math_dapo/acc/mean@32"]
    # without a data summary (rule data not run) the key's source and n are not checked
    assert metric_problems(paper, real_verl, True) == []


# --------------------------------------------------------------------------- the schema


@pytest.mark.parametrize(("rule", "key", "bad", "says"), [
    ("drift", "max", -0.01, "is less than or equal to the minimum of 0"),
    ("drift", "max", "0.01", "is not of type 'number'"),
    ("drift", "steps", 0, "is less than the minimum of 1"),
    ("drift", "steps", 2.5, "is not of type 'integer'"),
    ("entropy", "max_fall", 1.5, "is greater than the maximum of 1"),
    ("entropy", "floor", -0.1, "is less than or equal to the minimum of 0"),
    ("response_length", "min_ratio", -1, "is less than or equal to the minimum of 0"),
    ("clip_ratio", "max", 0, "is less than or equal to the minimum of 0"),
    ("validation", "k", -3, "is less than or equal to the minimum of 0"),
    ("validation", "responses", 0, "is less than the minimum of 1"),
    ("reward_floor", "minimum", "low", "is not of type 'number'"),
    ("nonfinite", "action", "halt", "is not one of"),
    ("drift", "action", False, "is not one of"),  # YAML 1.1 reads `off` as false,
])
def test_schema_refuses_a_wrong_type_or_sign_naming_the_key(rule, key, bad, says):
    cfg = copy.deepcopy(BASE)
    cfg["train"].setdefault("health", {}).setdefault(rule, {})[key] = bad
    with pytest.raises(cfgmod.ConfigError) as exc:
        Config.from_dict(cfg)
    assert f"train.health.{rule}.{key}: {bad!r} {says}" in str(exc.value)


def test_an_entropy_rule_that_watches_nothing_is_refused():
    with pytest.raises(cfgmod.ConfigError, match=r"train.health.entropy: floor, max_fall and "
                       r"max_rise are all null, so the rule \(warn\) would watch nothing"):
        health(entropy={"action": "warn", "floor": None, "max_fall": None, "max_rise": None})
    assert health(entropy={"action": "ignore", "floor": None, "max_fall": None,
                           "max_rise": None}).rules() == []


def test_the_collapse_shapes_outside_the_first_rules():
    """Issue 41: a reward falling to -0.97 or -0.6 from a run at 0.8 (the floor fires only at
    exactly -1), an entropy rising (verl #2738), a slow entropy collapse to 0.013 that never
    halves window over window, a length explosion from a baseline of 2,048 (4 x 2,048 is the
    8,192 cap, which a mean never exceeds): each fires its rule, by default."""
    schema = {**BASE, "train": {k: v for k, v in BASE["train"].items() if k != "health"}}
    rise = np.r_[np.full(20, 0.4), np.full(20, 1.0)]
    slow = np.geomspace(0.4, 0.013, 300)  # 20 steps: x 0.8, never a halving
    reward = "critic/score/mean"
    for low in (-0.97, -0.6):
        h = health(schema, reward_fall={})
        events = watch(h, recs(reward, [0.8] * 30 + [low] * 10))
        assert [(e.rule, e.action, e.first_step) for e in events] == [
            ("reward_fall", "stop", 31)], (low, events)
        assert health(schema, reward_floor={}).reward_floor.minimum == -1
        assert watch(health(schema, reward_floor={}), recs(reward, [0.8] * 30 + [low] * 10)) \
            == [], low  # the floor alone never saw it
    h = health(schema, entropy={})
    assert (h.entropy.floor, h.entropy.max_rise) == (0.02, 1)
    fired_rise = [e for e in watch(h, recs("actor/entropy", list(rise))) if "rose" in e.message]
    assert fired_rise and fired_rise[0].rule == "entropy", fired_rise
    slow_events = watch(h, recs("actor/entropy", list(slow)))
    assert [e.message.split(": ", 1)[1][:40] for e in slow_events] == [
        "actor/entropy below the floor 0.02 for 5"], slow_events
    assert watch(health(schema, entropy={"floor": None}), recs("actor/entropy", list(slow))) \
        == []  # the fall rule alone never saw it
    key = "response_length/mean"
    grow = [2048.0] * 5 + list(np.linspace(2048, 8100, 30)) + [8100.0] * 5
    h = health(schema, response_length={})
    assert watch(h, recs(key, grow)) == []  # without the cap: 4 x 2,048 is never exceeded
    events = [e for e in watch(h, recs(key, grow), response_cap=8192) if e.rule ==
              "response_length"]
    assert events and "0.9 x data.max_response_length" in events[0].message, events
    assert events[0].values[0][1] > 0.9 * 8192


def test_no_false_alarm_of_the_new_rules_on_noisy_published_curves():
    """The reward fall, the entropy rise and floor and the length cap bound stay silent on
    200 noisy copies of the published run (the reward with a batch mean's noise several
    times the real one: sd 0.05 where 2,048 responses of a -1/1 score give about 0.02)."""
    rng = np.random.default_rng(0)
    h = health(PAPER, only=False)
    base = published_run(300)
    quiet = 0
    for _ in range(200):
        records = copy.deepcopy(base)
        for r in records:
            d = r["data"]
            d["critic/score/mean"] += float(rng.normal(0, 0.05))
            d["actor/entropy"] *= float(1 + rng.normal(0, 0.1))
            d["response_length/mean"] *= float(1 + rng.normal(0, 0.05))
        events = [e for e in watch(h, records, response_cap=8192)
                  if e.rule in ("reward_fall", "entropy", "response_length")]
        quiet += not events
    assert quiet == 200


# --------------------------------------------------------------------------- no false alarm


def published_run(steps: int = 190) -> list[dict]:
    """The published curves the report draws (hy3rl.report.figures.PUBLISHED), interpolated
    per step (validation every TEST_FREQ=10 steps). KL-free, so critic/score/mean =
    critic/rewards/mean; the metrics with no published curve come from the trainer double."""
    from fixtures.trainer_double import double_module
    from hy3rl.report.figures import PUBLISHED

    normal = double_module().metrics
    out = []
    for step in range(1, steps + 1):
        data = {k: v for k, v in normal(step, steps).items() if not k.startswith("double/")}
        for key, ref in PUBLISHED.items():
            if key.startswith("val-") and step % 10:
                continue
            xs, ys = zip(*ref["points"], strict=True)
            data[key] = float(np.interp(step, xs, ys))
        data["critic/score/mean"] = data["critic/rewards/mean"]
        out.append({"step": step, "data": data})
    return out


def double_run(total: int = 200, test_freq: int = 10) -> list[dict]:
    """A normal trainer-double run's lines, from its own metric generator (as its main()
    adds validation every test_freq steps)."""
    from fixtures.trainer_double import double_module

    normal = double_module().metrics
    out = []
    for step in range(1, total + 1):
        data = normal(step, total)
        if step % test_freq == 0:
            data["val-core/math_dapo/acc/mean@1"] = round(0.84 + 0.04 * step / total, 6)
        out.append({"step": step, "data": data})
    return out


@pytest.mark.parametrize("base", ["paper", "default", "schema"])
@pytest.mark.parametrize("run", ["published", "double"])
def test_no_alarm_on_the_published_curves_nor_a_normal_double_run(base, run):
    cfg = {"paper": PAPER, "default": BASE,
           "schema": {**BASE, "train": {k: v for k, v in BASE["train"].items()
                                        if k != "health"}}}[base]
    h = Config.from_dict(cfg).train.health
    records = published_run() if run == "published" else double_run()
    watched = {k for _, k in h.watched()}
    # the run carries what the rules watch (else "no alarm" would prove nothing)
    logged = {k for r in records for k in r["data"]}
    assert watched - logged <= {"val-core/math_dapo/acc/mean@32"}, watched - logged
    assert watch(h, records) == []


def test_the_paper_thresholds_catch_the_failures_they_are_for():
    """The same published run with a collapse injected from step 60 fires the paper's rules
    (so the no-alarm test above is not passing for a rule that never fires)."""
    h = Config.from_dict(PAPER).train.health
    records = published_run()
    for r in records[59:]:
        r["data"].update({"training/rollout_probs_diff_mean": 0.05,
                          "critic/score/mean": -1.0, "response_length/mean": 5.0,
                          "response_length/clip_ratio": 0.0, "actor/entropy": 0.05})
        if "val-core/math_dapo/acc/mean@1" in r["data"]:
            r["data"]["val-core/math_dapo/acc/mean@1"] = 0.2
    records[99]["data"]["actor/grad_norm"] = float("nan")
    events = watch(h, records)
    first = {}
    for e in events:
        first.setdefault(e.rule, (e.step, e.first_step, e.action))
    assert first == {"drift": (64, 60, "stop"), "reward_floor": (64, 60, "stop"),
                     "reward_fall": (63, 60, "stop"),
                     "response_length": (64, 60, "warn"), "validation": (70, 60, "warn"),
                     "entropy": (71, 52, "warn"), "nonfinite": (100, 100, "stop")}, first
    assert last_healthy(range(20, 201, 20), events) == 40


def test_a_blind_rule_says_so_on_verls_own_lines(real_verl: Path, tmp_path: Path):
    """Issue 41: lines written by the pinned verl's own FileLogger where the drift key is
    renamed (absent), the entropy is NaN (null) and the validation logs another n than the
    rule's key: each of those rules raises one `blind` warn naming its key, after
    train.health.blind_lines logged lines (the validation rule: 2 validation lines), once
    until the key comes again; the rules whose metrics come judge every line and stay
    quiet. A blind event is a warn, never a stop: it names no checkpoint sick."""
    from fixtures.verl_records import write_like_verl
    from hy3rl.health import Watcher, last_healthy
    from hy3rl.verl_log import read_metrics

    h = Config.from_dict(PAPER).train.health
    assert h.blind_lines == 5
    datas = []
    for step in range(1, 21):
        d = {"actor/pg_loss": 0.01, "actor/grad_norm": 0.5, "critic/score/mean": 0.5,
             "response_length/mean": 3000.0, "response_length/clip_ratio": 0.01,
             "training/rollout_probs_diff_avg": 0.001,  # renamed: the rule's key is absent
             "actor/entropy": math.nan if step <= 12 else 0.4}
        if step % 2 == 0:
            d["val-core/math_dapo/acc/mean@32"] = 0.4  # the rule watches mean@1
        datas.append(d)
    path = write_like_verl(real_verl, tmp_path / "metrics.jsonl", datas)
    assert '"actor/entropy":null' in path.read_text()  # verl's own encoding of NaN
    w = Watcher(h)
    for rec in read_metrics(path):
        w.feed(rec)
    blind = [(e.rule, e.metric, e.first_step, e.step, e.action) for e in w.events
             if e.kind == "blind"]
    assert blind == [("validation", "val-core/math_dapo/acc/mean@1", 2, 4, "warn"),
                     ("drift", "training/rollout_probs_diff_mean", 1, 5, "warn"),
                     ("entropy", "actor/entropy", 1, 5, "warn")], blind
    assert [e for e in w.events if e.kind != "blind"] == []  # no threshold fired
    msg = next(e.message for e in w.events if e.rule == "drift")
    assert msg.startswith("health rule drift is blind: training/rollout_probs_diff_mean "
                          "absent or null in the last 5 logged lines (steps 1-5); it judged "
                          "0 step(s) so far"), msg
    judged = w.judged()
    assert judged == {"nonfinite": 20, "drift": 0, "entropy": 8, "response_length": 20,
                      "clip_ratio": 20, "reward_floor": 20, "reward_fall": 20,
                      "validation": 0}, judged
    assert last_healthy([4, 8, 12, 16, 20], w.events) == 20  # blind is no sickness
    # the entropy came back at step 13: null again for 5 lines is a new blind episode
    for step in range(21, 26):
        w.feed({"step": step, "data": {**datas[0], "actor/entropy": None}})
    again = [e for e in w.events if e.kind == "blind" and e.rule == "entropy"]
    assert [(e.first_step, e.step) for e in again] == [(1, 5), (21, 25)]
