"""Rule release (hy3rl.release) on real files: the session's tiny Hy3 as the base, copies of
it as checkpoints "trained" (one tensor changed) in verl's layout, evaluated by the real
hy3rl.evaluate.run (whose samples.meta.json records the weights' sha256). A good release
passes every check and its card parses; each bad input fails its check by name and leaves
nothing that looks like a release."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from fixtures.checkpoint import export_like_the_pinned_stack, rewrite_checkpoint
from fixtures.common import make_config
from fixtures.eval import make_val_parquet
from hy3rl import evaluate, release
from hy3rl.layout import REPORT_FILES, Layout

RUN = "rel"
TRAINED = "model.layers.1.mlp.experts.0.up_proj.weight"
BIAS = "model.layers.1.mlp.expert_bias"


def _cfg(root: Path, base: Path, model: dict | None = None, **release_cfg):
    return make_config(
        run={"name": RUN, "results_root": str(root / "results")},
        train={"checkpoint_root": str(root / "ckpt")},
        cluster={"gpu": True},
        model=model or {"source": str(base)},
        eval={"num_problems": 1, "n_samples": 1, "max_tokens": 2, "steps": [2]},
        release={"dir": str(root / "released"), "max_tokens": 4, "threads": 2, **release_cfg},
    )


def _train(hf: Path, base: Path, name: str, delta: float) -> None:
    """A "trained" export of ``base`` shaped as the pinned stack exports a run that did not
    train MTP (no MTP layer, num_nextn_predict_layers 0): ``name`` moved by ``delta``, every
    other tensor kept."""
    shutil.copytree(base, hf)
    rewrite_checkpoint(hf, lambda t: {**t, name: (t[name].float() + delta).to(t[name].dtype)})
    export_like_the_pinned_stack(hf)


@pytest.fixture(scope="module")
def run_template(tmp_path_factory, tiny_hy3_dir) -> Path:
    """A run's files as rule release reads them: checkpoints of steps 2 and 3 (final),
    evaluated by hy3rl.evaluate.run; summary, selection (step 2), plan (bias update rate 0),
    train sentinel. Tests copy it (run_copy) before changing anything."""
    root = tmp_path_factory.mktemp("release-run")
    cfg = _cfg(root, tiny_hy3_dir)
    layout = Layout.from_config(cfg)
    val = make_val_parquet(Path(layout.data_val), n_problems=3)
    for step, delta in ((2, 0.25), (3, 0.5)):
        _train(layout.checkpoint_hf_model(step), tiny_hy3_dir, TRAINED, delta)
    rows = []
    for tag, step in (("base", None), ("step2", 2), ("final", 3)):
        if step is not None:  # the released tags' generations (base's: its summary row)
            evaluate.run(cfg.eval, tag=tag, model=layout.checkpoint_hf_model(step), val=val,
                         samples=Path(layout.eval_samples(tag)),
                         meta=Path(layout.eval_samples_meta(tag)))
        rows.append({"tag": tag, "num_problems": 1, "n": 1, "math_dapo_avg": 0.25 * (step or 1),
                     "math_dapo_ci": [0.0, 0.5 + 0.1 * (step or 0)]})
    test_rows = [{**r, "role": role, "step": s} for r, role, s in
                 zip(rows, ("base", "selected", "final"), (None, 2, 3), strict=True)]
    selected = {"rule": {"set": "dapo_heldout", "key": "math_dapo avg@1", "tie": "earliest step"},
                "selected": {"tag": "step2", "step": 2, "value": 0.75,
                             "reason": "highest value 0.75", "missing": []},
                "test": {"rows": test_rows}, "verdict": "selected and final do not differ."}
    files = {layout.eval_summary: {"tags": ["base", "step2", "final"], "rows": rows},
             layout.eval_selected: selected,
             layout.train_plan: {"resolved": {release.BIAS_RATE_KEY: {"value": 0.0},
                                              "algorithm.adv_estimator": {"value": "grpo"}},
                                 "identity": {"trajectory": {"id": "abc123"}}},
             layout.train_done: {"final_step": 3, "total_training_steps": 3,
                                 "attempts": [{"attempt": 1}], "steps_lost_total": 0}}
    for path, doc in files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc))
    _report(layout, [("base", ""), ("step2", "2"), ("final", "3")])
    return root


def _report(layout: Layout, shown: list[tuple[str, str]]) -> None:
    """The report's files as rule report leaves them, showing the evaluations ``shown`` (tag,
    step) in eval_headline.csv (the real report's rendering and copy run through the
    workflow in tests/test_rerun_identity.py)."""
    folder = Path(layout.report_html).parent
    folder.mkdir(parents=True, exist_ok=True)
    for name, _ in REPORT_FILES:
        (folder / name).write_bytes(f"{name} of run {RUN}\n".encode())
    (folder / "eval_headline.csv").write_text(
        "tag,step,grader,avg@n\n" + "".join(f"{t},{s},math_dapo (primary),0.5\n"
                                             for t, s in shown))


@pytest.fixture
def run_copy(run_template, tmp_path, tiny_hy3_dir):
    """A private copy of the run: (cfg, layout, records(tag))."""
    root = tmp_path / "run"
    shutil.copytree(run_template, root)
    cfg = _cfg(root, tiny_hy3_dir)
    layout = Layout.from_config(cfg)

    def records() -> release.Records:
        return release.Records(
            val=Path(layout.data_val), summary=Path(layout.eval_summary),
            plan=Path(layout.train_plan), selected=Path(layout.eval_selected),
            train_done=Path(layout.train_done), report=Path(layout.report_html))

    return cfg, layout, records


def _build(run_copy, tag: str = "final") -> dict:
    cfg, layout, records = run_copy
    return release.build(cfg, layout, tag, records(), threads=2)


def _refused(run_copy, tag: str = "final") -> dict[str, dict]:
    """Build, expect a refusal; return the failed checks by name, after asserting that
    nothing release-looking is left (no directory, no temporary one, no release.json)."""
    cfg, layout, _ = run_copy
    with pytest.raises(release.ReleaseFailed) as exc:
        _build(run_copy, tag)
    dest = layout.release_model(tag)
    assert not dest.exists()
    assert not list(dest.parent.glob(f".{dest.name}*"))
    assert not Path(layout.release_record(tag)).exists()
    doc = json.loads(Path(layout.release_checks(tag)).read_text())
    failed = {c["name"]: c for c in doc["checks"] if c["status"] == "fail"}
    assert failed and doc["ok"] is False
    for name in failed:
        assert name in str(exc.value)
    return failed


def _problems(check: dict) -> str:
    return "\n".join(check["problems"]) + check["details"]


def _evaluated_as_now(layout: Layout, tag: str, hf: Path) -> None:
    """Record ``tag``'s evaluation as having loaded ``hf`` as it is now (as a new
    evaluation would)."""
    meta_path = Path(layout.eval_samples_meta(tag))
    meta = json.loads(meta_path.read_text())
    meta["files"] = evaluate.computing_files(hf)
    meta["weights"] = {k: v["sha256"] for k, v in meta["files"].items()
                       if k.endswith(".safetensors")}
    meta_path.write_text(json.dumps(meta))


def test_good_release_passes_every_check_and_its_card_parses(run_copy, tiny_hy3_dir):
    from huggingface_hub import ModelCard

    cfg, layout, _ = run_copy
    rec = _build(run_copy, "selected")
    dest = layout.release_model("selected")
    assert dest == (Path(cfg.release.dir) / RUN / "selected").resolve() and dest.is_dir()
    doc = json.loads(Path(layout.release_checks("selected")).read_text())
    assert {c["name"]: c["status"] for c in doc["checks"]} == {
        n: "pass" for n in ("tokenizer", "config", "encodings", "index", "headers",
                            "index_vs_shards", "inventory", "fixed_tensors", "generates",
                            "report", "card", "evaluated")}
    assert doc["size"]["files"] == len(rec["files"]) == 10 + len(REPORT_FILES)
    assert rec["evaluated_tag"] == "step2" and rec["step"] == 2
    # evaluate.run recorded the sha256 of each weight file it loaded; they are the release's
    meta = json.loads(Path(layout.eval_samples_meta("step2")).read_text())
    assert meta["weights"] == {k: v["sha256"] for k, v in rec["files"].items()
                               if k.endswith(".safetensors")}
    assert len(meta["weights"]) == 3
    assert rec["source"].endswith("global_step_2/actor/model/huggingface")
    # every file that computes from the evaluated checkpoint (issue 42: the tokenizer and the
    # generation config too, which its evaluation loaded), recorded by the evaluation
    assert set(meta["files"]) == {k for k in rec["files"] if "/" not in k and k != "README.md"}
    assert all(rec["files"][k]["sha256"] == v["sha256"] for k, v in meta["files"].items())
    for name in ("tokenizer.json", "generation_config.json", "config.json",
                 "model-00001-of-00003.safetensors"):
        assert "global_step_2" in rec["origin"][name], rec["origin"]
    assert set(meta["prompt_ids"]) == {"0"}  # eval.num_problems 1
    assert "tiny-hy3.json" not in rec["files"] and "README.md" in rec["files"]
    assert set(rec["files"]) == {p.relative_to(dest).as_posix() for p in dest.rglob("*")
                                  if p.is_file()}
    # the run's report beside the card, byte for byte, linked from it
    for name, _ in REPORT_FILES:
        assert (dest / "report" / name).read_bytes() == (
            Path(layout.report_html).parent / name).read_bytes()
    assert [a["problem_id"] for a in rec["generated"]] == ["0", "1"]
    assert all(1 <= a["num_tokens"] <= 4 for a in rec["generated"])
    fixed = next(c for c in doc["checks"] if c["name"] == "fixed_tensors")
    # 2 MoE layers (the MTP layer's is not exported: no MTP training, release.mtp none)
    assert "2 of 2 expert biases bit-identical" in fixed["details"]
    inventory = next(c for c in doc["checks"] if c["name"] == "inventory")
    assert "the base's 29 MTP tensors left out (MTP not trained" in inventory["details"]
    assert "1 of " in fixed["details"]  # one trained tensor changed
    card = ModelCard.load(dest / "README.md")
    assert card.data.library_name == "transformers" and card.data.model_name == "rel-selected"
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results == {"avg@1": 0.5, "avg@1_ci_low": 0.0, "avg@1_ci_high": 0.7,
                       "math_dapo avg@1": 0.75}
    assert "| selected | step2 | 2 | 0.5000 | [0.0000, 0.7000] |" in card.text
    assert "| final | final | 3 | 0.7500 |" in card.text
    assert "abc123" in card.text and "algorithm.adv_estimator" in card.text
    assert "[report/index.html](report/index.html)" in card.text
    assert "This release has no MTP layer: MTP not trained" in card.text
    assert "num_nextn_predict_layers: 0" in card.text
    assert not list(dest.parent.glob(".selected*"))


def test_a_report_rendered_before_the_evaluation_fails_report_by_file(run_copy):
    """The report copied beside the card must show the released evaluation: one rendered
    before it (no row of the tag), or showing the tag at another step, is refused; so is a
    report missing one of its files."""
    _, layout, _ = run_copy
    _report(layout, [("base", ""), ("step2", "2")])
    failed = _refused(run_copy, "final")
    assert set(failed) == {"report"}, failed
    assert "eval_headline.csv: no row of final" in _problems(failed["report"])
    _report(layout, [("base", ""), ("step2", "2"), ("final", "2")])
    assert "final is at step ['2'], the release at 3" in _problems(
        _refused(run_copy, "final")["report"])
    _report(layout, [("final", "3")])
    (Path(layout.report_html).parent / "fig_eval_curves.png").unlink()
    failed = _refused(run_copy, "final")
    assert set(failed) == {"report"}, failed
    assert "lacks fig_eval_curves.png" in _problems(failed["report"])


def test_a_report_copy_unlike_its_source_fails_report_by_file(run_copy, monkeypatch):
    """A copy that does not hold the report's bytes (a truncating filesystem) is caught by
    reading it back, naming the file."""
    real = shutil.copyfile

    def truncating(src, dst, *args, **kwargs):
        out = real(src, dst, *args, **kwargs)
        if Path(src).name == "index.html":
            Path(dst).write_bytes(Path(src).read_bytes()[:5])
        return out

    monkeypatch.setattr(release.shutil, "copyfile", truncating)
    failed = _refused(run_copy, "final")
    assert set(failed) == {"report"}, failed
    assert "report/index.html: differs from" in _problems(failed["report"])


def test_release_replaces_an_earlier_one_whole(run_copy):
    """Through the rule's entry point (release.run, the rule's named inputs)."""
    cfg, layout, _ = run_copy
    dest = layout.release_model("final")
    dest.mkdir(parents=True)
    (dest / "stale.bin").write_text("old")
    inputs = {"val": layout.data_val, "summary": layout.eval_summary,
              "plan": layout.train_plan, "train_done": layout.train_done,
              "report": layout.report_html}
    rec = release.run(cfg, "final", inputs=inputs, out=Path(layout.release_record("final")),
                      threads=2)
    assert json.loads(Path(layout.release_record("final")).read_text()) == rec
    assert rec["samples_meta"] == layout.eval_samples_meta("final")
    assert not (dest / "stale.bin").exists() and (dest / "README.md").is_file()
    assert not list(dest.parent.glob(".final*"))


def test_missing_expert_tensor_fails_inventory_by_name(run_copy):
    cfg, layout, _ = run_copy
    gone = "model.layers.2.mlp.experts.3.down_proj.weight"
    rewrite_checkpoint(layout.checkpoint_hf_model(3),
                       lambda t: {k: v for k, v in t.items() if k != gone})
    failed = _refused(run_copy)
    assert f"missing tensor {gone}" in _problems(failed["inventory"])


def test_the_mtp_policy_follows_what_was_trained(run_copy, tiny_hy3_dir, tmp_path):
    """Issue 42: the paper's recipe trains no MTP, and the pinned stack's export then has no
    MTP layer (num_nextn_predict_layers 0): released under release.mtp auto (none), the
    card saying so (test above). An export that kept the MTP layer, or says another
    num_nextn_predict_layers, is refused naming them; release.mtp trained on a run that did
    not train MTP is refused by key; with MTP trained (the plan's composed
    actor_rollout_ref.model.mtp.enable) the release must hold the whole MTP layer."""
    cfg, layout, _ = run_copy
    hf = layout.checkpoint_hf_model(3)
    shutil.rmtree(hf)
    shutil.copytree(tiny_hy3_dir, hf)  # the MTP layer kept, num_nextn_predict_layers 1
    rewrite_checkpoint(hf, lambda t: {**t, TRAINED: (t[TRAINED].float() + 0.5).to(
        t[TRAINED].dtype)})
    failed = _refused(run_copy)
    text = _problems(failed["inventory"])
    assert "MTP tensor model.layers.3.eh_proj.weight in model-00003-of-00003.safetensors: " \
        "release.mtp none (MTP not trained" in text, text
    assert "num_nextn_predict_layers 1, release.mtp none needs 0" in text
    # release.mtp trained on a run that did not train MTP: a bad input, by key
    trained_cfg = _cfg(Path(cfg.release.dir).parent, tiny_hy3_dir, mtp="trained")
    _, _, records = run_copy
    with pytest.raises(release.ReleaseError, match=r"release.mtp is trained but the run did "
                       r"not train MTP \(actor_rollout_ref.model.mtp.enable not recorded"):
        release.build(trained_cfg, layout, "final", records(), threads=2)
    # MTP trained: the plan says so; the full export passes the inventory, the pinned
    # stack's MTP-less one misses the layer by name
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"resolved": {release.MTP_KEY: {"value": True}}}))
    base_st, _ = release.headers(tiny_hy3_dir, 2)
    mtp = release.mtp_policy(cfg, plan, tiny_hy3_dir, base_st.tensors)
    assert (mtp.policy, mtp.nextn, mtp.absent) == ("trained", 1, frozenset())
    full, _ = release.headers(hf, 2)
    assert release.check_inventory(base_st.tensors, full.tensors, tiny_hy3_dir, mtp,
                                   hf).status == "pass"
    export_like_the_pinned_stack(hf)
    cut, _ = release.headers(hf, 2)
    res = release.check_inventory(base_st.tensors, cut.tensors, tiny_hy3_dir, mtp, hf)
    assert res.status == "fail" and "missing tensor model.layers.3.eh_proj.weight" in \
        _problems(dataclasses.asdict(res))
    assert "num_nextn_predict_layers 0, release.mtp trained needs 1" in \
        _problems(dataclasses.asdict(res))


def test_missing_shard_fails_the_index_by_name(run_copy):
    cfg, layout, _ = run_copy
    (layout.checkpoint_hf_model(3) / "model-00002-of-00003.safetensors").unlink()
    failed = _refused(run_copy)
    assert "shard model-00002-of-00003.safetensors is missing" in _problems(failed["index"])
    assert "inventory" in failed


def test_changed_byte_fails_evaluated_by_file(run_copy):
    """One byte of a trained matrix changed after the evaluation: only the hashes see it."""
    from hy3rl.checkpoint import read_header

    cfg, layout, _ = run_copy
    shard = layout.checkpoint_hf_model(3) / "model-00003-of-00003.safetensors"
    info = next(t for t in read_header(shard).tensors.values() if len(t.shape) == 2)
    with open(shard, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        fh.seek(8 + n + info.start + 1)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    failed = _refused(run_copy)
    assert set(failed) == {"evaluated"}
    assert "model-00003-of-00003.safetensors: sha256" in _problems(failed["evaluated"])
    assert "model-00001" not in _problems(failed["evaluated"])


def test_weights_unlike_the_evaluated_ones_fail_by_file(run_copy, tiny_hy3_dir):
    """The evaluation loaded other weights (the base's) than the release holds."""
    cfg, layout, _ = run_copy
    meta_path = Path(layout.eval_samples_meta("final"))
    meta = json.loads(meta_path.read_text())
    meta["files"].update({k: v for k, v in evaluate.computing_files(tiny_hy3_dir).items()
                          if k.endswith(".safetensors")})
    meta_path.write_text(json.dumps(meta))
    failed = _refused(run_copy)
    assert set(failed) == {"evaluated"}
    text = _problems(failed["evaluated"])
    # the trained tensor lives in one shard, the MTP layer the export left out in another:
    # only those files differ, each named
    differing = sorted(line.split(":")[0] for line in failed["evaluated"]["problems"]
                       if "sha256" in line)
    assert differing == ["model-00002-of-00003.safetensors",
                         "model-00003-of-00003.safetensors"], differing
    assert str(meta_path) in text


@pytest.mark.parametrize(("key", "check"), [("files", "evaluated"),
                                            ("prompt_ids", "encodings")])
def test_an_evaluation_without_its_records_of_what_it_loaded_fails(run_copy, key, check):
    """An evaluation made before its files and prompt encodings were recorded cannot vouch
    for the release: evaluate the tag again."""
    cfg, layout, _ = run_copy
    meta_path = Path(layout.eval_samples_meta("final"))
    meta = json.loads(meta_path.read_text())
    del meta[key]
    meta_path.write_text(json.dumps(meta))
    failed = _refused(run_copy)
    assert set(failed) == {check}
    assert f"records no '{key}'" in _problems(failed[check])


def test_a_missing_evaluation_record_fails_evaluated_by_name(run_copy):
    """Issue 42: the evaluation's record gone: the `evaluated` check fails naming it, with
    checks.json written (not an exception after every other check)."""
    cfg, layout, _ = run_copy
    meta_path = Path(layout.eval_samples_meta("final"))
    meta_path.unlink()
    failed = _refused(run_copy)
    assert set(failed) == {"evaluated", "encodings"}, failed
    assert f"{meta_path}: missing" in _problems(failed["evaluated"])


def test_changed_tokenizer_fails_by_file(run_copy):
    cfg, layout, _ = run_copy
    tok = layout.checkpoint_hf_model(3) / "tokenizer.json"
    doc = json.loads(tok.read_text())
    doc["added_tokens"].append({**doc["added_tokens"][-1], "id": 512, "content": "<|new|>"})
    tok.write_text(json.dumps(doc))
    failed = _refused(run_copy)
    assert set(failed) == {"tokenizer", "evaluated"}
    text = _problems(failed["tokenizer"])
    assert str(tok.parent / "tokenizer.json") in text and "'<|new|>'" in text
    assert "tokenizer.json: key(s) added_tokens differ from the file evaluated" in \
        _problems(failed["evaluated"])


def test_moved_expert_bias_fails_fixed_tensors_by_name(run_copy):
    cfg, layout, _ = run_copy
    hf = layout.checkpoint_hf_model(3)
    rewrite_checkpoint(hf, lambda t: {**t, BIAS: t[BIAS] + 1.0})
    _evaluated_as_now(layout, "final", hf)
    failed = _refused(run_copy)
    assert set(failed) == {"fixed_tensors"}
    assert f"{BIAS} in " in _problems(failed["fixed_tensors"])


def test_the_base_released_as_trained_fails_fixed_tensors(run_copy, tiny_hy3_dir):
    cfg, layout, _ = run_copy
    hf = layout.checkpoint_hf_model(3)
    shutil.rmtree(hf)
    shutil.copytree(tiny_hy3_dir, hf)
    failed = _refused(run_copy)
    assert "none of" in _problems(failed["fixed_tensors"])
    assert "the release holds the base's weights" in _problems(failed["fixed_tensors"])


def test_a_model_that_does_not_load_fails_generates(run_copy):
    cfg, layout, _ = run_copy
    conf = layout.checkpoint_hf_model(3) / "config.json"
    doc = json.loads(conf.read_text())
    doc["hidden_act"] = "no_such_activation"
    conf.write_text(json.dumps(doc))
    _evaluated_as_now(layout, "final", conf.parent)
    failed = _refused(run_copy)
    assert set(failed) == {"generates", "config"}
    assert "does not load or generate" in _problems(failed["generates"])
    assert 'config.json hidden_act: "no_such_activation", the base\'s "silu"' in \
        _problems(failed["config"])


def test_with_vllm_the_generates_check_runs_the_evaluations_vllm_path(run_copy, tiny_hy3_dir):
    """eval.backend vllm: the release directory goes through hy3rl.evaluate.run's vLLM path
    (greedy, release.problems, release.max_tokens), its files beside the checks, never in the
    release. vLLM does not import here: `not run` with the reason, never a pass; the other
    checks pass and the release is made (a not-run check is no failure)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: this test is of the machine without it")
    cfg, layout, records = run_copy
    root = Path(cfg.release.dir).parent
    vcfg = make_config(
        run={"name": RUN, "results_root": str(root / "results")},
        train={"checkpoint_root": str(root / "ckpt")}, cluster={"gpu": True},
        model={"source": str(tiny_hy3_dir)},
        eval={"backend": "vllm", "num_problems": 1, "n_samples": 1, "max_tokens": 2,
              "steps": [2], "vllm": {"nodes": 1, "gpus_per_node": 1,
                                     "tensor_parallel_size": 1}},
        release={"dir": cfg.release.dir, "max_tokens": 4, "threads": 2})
    rec = release.build(vcfg, layout, "final", records(), threads=2)
    doc = json.loads(Path(layout.release_checks("final")).read_text())
    gen = next(c for c in doc["checks"] if c["name"] == "generates")
    assert gen["status"] == "not run" and "vllm is not importable here" in gen["details"], gen
    assert rec["generated"] == [] and doc["counts"]["not run"] == 1
    work = Path(layout.release_checks("final")).parent / "generates"
    meta = json.loads((work / "samples.meta.json").read_text())
    assert meta["status"] == "not run" and meta["backend"] == "vllm"
    assert (meta["sampling"]["temperature"], meta["sampling"]["n_samples"],
            meta["sampling"]["max_tokens"], meta["num_problems"]) == (0.0, 1, 4, 2), meta
    assert meta["backend_settings"]["engine"]["model"].endswith(".final.partial-"
                                                               f"{__import__('os').getpid()}")
    assert not any(p.name.startswith("samples") for p in Path(rec["dir"]).iterdir())


def test_a_card_whose_metadata_breaks_fails_card(run_copy, monkeypatch):
    """A template that corrupts the front matter: the card check reads it back and fails."""
    monkeypatch.setattr(release, "CARD_TEMPLATE",
                        release.CARD_TEMPLATE.replace("{{ card_data }}",
                                                      "{{ card_data }}\nlicense: [unclosed"))
    failed = _refused(run_copy)
    assert set(failed) == {"card"}
    assert "README.md" in _problems(failed["card"])


def test_an_empty_export_is_refused_before_any_check(run_copy):
    cfg, layout, records = run_copy
    hf = layout.checkpoint_hf_model(3)
    shutil.rmtree(hf)
    hf.mkdir()
    with pytest.raises(release.ReleaseError, match="no config.json or no"):
        _build(run_copy)
    dest = layout.release_model("final")
    assert not dest.exists() and not list(dest.parent.glob(".final*"))


def test_nothing_selected_is_refused_with_the_reason(run_copy):
    cfg, layout, _ = run_copy
    path = Path(layout.eval_selected)
    doc = json.loads(path.read_text())
    doc["selected"] = {"tag": None, "reason": "no candidate has a held-out result"}
    path.write_text(json.dumps(doc))
    with pytest.raises(release.ReleaseError, match="no candidate has a held-out result"):
        _build(run_copy, "selected")


@pytest.mark.parametrize(("sections", "key"), [
    ({"eval": {"steps": [2], "select": None}, "release": {"tags": ["selected", "final"]}},
     "'selected' needs eval.select"),
    ({"data": {"heldout": None}, "eval": {"steps": [2]}, "release": {"tags": ["selected"]}},
     "'selected' needs eval.select and data.heldout"),
    ({"eval": {"steps": [2], "final": False}, "release": {"tags": ["final"]}},
     "'final' needs eval.final"),
])
def test_a_release_tag_without_its_evaluation_is_refused_by_key(sections, key):
    cfg = make_config(cluster={"gpu": True}, **sections)
    with pytest.raises(release.ReleaseError, match=key):
        release.release_tags(cfg)


def test_release_tags_of_the_default_and_of_a_gpu_run():
    assert release.release_tags(make_config()) == []  # no training, no release
    assert release.release_tags(make_config(cluster={"gpu": True}, eval={"steps": [2]})) == \
        ["selected", "final"]
    # Unset, the tags are what the DAG evaluates: no selection without eval.select (a run
    # without a held-out set is not refused), no final without eval.final; [] is none.
    assert release.release_tags(make_config(cluster={"gpu": True}, eval={
        "steps": [2], "select": None})) == ["final"]
    assert release.release_tags(make_config(cluster={"gpu": True}, eval={
        "steps": [2], "select": None, "final": False})) == []
    assert release.release_tags(make_config(cluster={"gpu": True}, eval={"steps": [2]},
                                            release={"tags": []})) == []


def test_the_card_names_a_hub_base_at_its_revision_with_the_base_license(run_copy, tmp_path,
                                                                           tiny_hy3_dir):
    """A hub base (model.source a repo id, downloaded to model.dir) whose own card states a
    license: the release's card names the repo and revision and carries the license."""
    from huggingface_hub import ModelCard

    _, layout, records = run_copy
    base = tmp_path / "hub-base"
    shutil.copytree(tiny_hy3_dir, base)
    (base / "README.md").write_text("---\nlicense: other\nlicense_name: hy3-license\n"
                                    "license_link: LICENSE\n---\n# base\n")
    (base / "LICENSE").write_text("the base's license text\n")
    cfg = _cfg(tmp_path / "run", base,
               model={"source": "tencent/Hy3", "revision": "a" * 40, "dir": str(base)})
    rec = release.build(cfg, layout, "final", records(), threads=2)
    dest = Path(rec["dir"])
    data = ModelCard.load(dest / "README.md").data
    assert (data.base_model, data.base_model_revision) == ("tencent/Hy3", "a" * 40)
    assert (data.license, data.license_name, data.license_link) == \
        ("other", "hy3-license", "LICENSE")
    assert (dest / "LICENSE").read_text() == "the base's license text\n"


def test_the_card_lists_the_training_data_under_datasets_only(run_copy, tmp_path,
                                                              tiny_hy3_dir):
    """Issue 42: the Hub defines a card's `datasets` as the data the model was trained on:
    DAPO-Math-17k, not the AIME-2024 test set (which stays under the evaluation results)."""
    from huggingface_hub import ModelCard

    _, layout, records = run_copy
    cfg = _cfg(tmp_path / "run", tiny_hy3_dir)
    raw = {**cfg.raw, "data": {**cfg.raw["data"],
                               "train": {**cfg.raw["data"]["train"],
                                         "source": "BytedTsinghua-SIA/DAPO-Math-17k"},
                               "val": {**cfg.raw["data"]["val"],
                                       "source": "HuggingFaceH4/aime_2024"}}}
    from hy3rl.settings import Config

    rec = release.build(Config.from_dict(raw), layout, "final", records(), threads=2)
    data = ModelCard.load(Path(rec["dir"]) / "README.md").data
    assert data.datasets == ["BytedTsinghua-SIA/DAPO-Math-17k"], data.datasets
    assert {r.dataset_type for r in data.eval_results} == {"HuggingFaceH4/aime_2024"}


def test_endpoint_credentials_are_redacted():
    """Issue 42: an endpoint given with credentials (http://user:secret@host) names them
    for the redactor of the upload's messages and log records."""
    from hy3rl.redact import Redactor

    secrets = release.endpoint_secrets("http://alice:s3cretpass@hub.example:8080/x")
    assert secrets == ["alice:s3cretpass", "s3cretpass"]
    said = Redactor(secrets).text(
        "ConnectError for url http://alice:s3cretpass@hub.example:8080/api/models")
    assert "s3cretpass" not in said and "alice:" not in said, said
    assert release.endpoint_secrets("https://huggingface.co") == []


# --------------------------------------------------------------------------- the upload

TOKEN = "hf_releaseUploadTestToken0123456789"
HUB_REPO = "hy3rl-test/rel-final"


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """The fake hub's endpoint and a token in the environment (no saved token: HF_HOME is
    the test's)."""
    from fixtures.hub import FakeHub, serve

    with serve(FakeHub("hy3rl-test/none", {}, set())) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield hub


def _hub_cfg(root: Path, base: Path, **hub):
    return _cfg(root, base, hub={"repo": HUB_REPO, **hub})


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _token_nowhere(*roots: Path) -> None:
    for root in roots:
        for f in root.rglob("*"):
            if f.is_file():
                assert TOKEN.encode() not in f.read_bytes(), f"the token is in {f}"


def test_upload_records_the_commit_and_writes_no_token(run_copy, hub_env, tiny_hy3_dir,
                                                       tmp_path, capsys):
    _, layout, records = run_copy
    cfg = _hub_cfg(tmp_path / "run", tiny_hy3_dir)
    rec = release.build(cfg, layout, "final", records(), threads=2)
    repo = hub_env.repos[HUB_REPO]
    hub = rec["hub"]
    assert (hub["repo"], hub["revision"], hub["private"]) == (HUB_REPO, "main", True)
    # 10 model files and the report's 15 beside the card (report/...)
    assert hub["commit"] == repo.heads["main"] and hub["pushed"] == len(rec["files"]) == 25
    assert hub["url"] == f"{hub_env.url}/{HUB_REPO}/commit/{hub['commit']}"
    assert repo.private and hub["deleted"] == []
    assert json.loads(Path(layout.release_record("final")).read_text())["hub"] == hub
    # one commit on top of the hub's initial one, holding every file byte for byte
    assert repo.commits[hub["commit"]].parent is not None
    held = repo.files("main")
    assert set(held) == set(rec["files"]) | {".gitattributes"} and "report/index.html" in held
    assert {n: _sha(held[n]) for n in rec["files"]} == \
        {n: f["sha256"] for n, f in rec["files"].items()}
    # the token went to the hub with every write, and nowhere else
    writes = [r for r in hub_env.requests if r.method == "POST"]
    assert {r.path.rsplit("/", 2)[-2] for r in writes} >= {"preupload", "commit"}
    assert all(r.authorization == f"Bearer {TOKEN}" for r in writes)
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err and hub["commit"] in out.out
    _token_nowhere(tmp_path)


def test_an_upload_target_with_other_content_is_refused_naming_the_repo(
        run_copy, hub_env, tiny_hy3_dir, tmp_path):
    """The repository holds another release: refused, by name; the verified directory stays,
    no release.json claims it. With overwrite the same release goes on and replaces it."""
    _, layout, records = run_copy
    other = hub_env.make_repo(HUB_REPO, {"README.md": b"another model\n",
                                         "model.safetensors": b"other weights"})
    before = other.heads["main"]
    cfg = _hub_cfg(tmp_path / "run", tiny_hy3_dir)
    with pytest.raises(release.ReleaseError, match=f"release.hub.repo {HUB_REPO}") as exc:
        release.build(cfg, layout, "final", records(), threads=2)
    assert "model.safetensors (not in the release)" in str(exc.value)
    assert "README.md (" in str(exc.value) and "release.hub.overwrite" in str(exc.value)
    assert other.heads["main"] == before  # nothing pushed
    dest = layout.release_model("final")
    assert (dest / "README.md").is_file() and not Path(layout.release_record("final")).exists()
    assert json.loads(Path(layout.release_checks("final")).read_text())["ok"] is True
    rec = release.build(_hub_cfg(tmp_path / "run", tiny_hy3_dir, overwrite=True), layout,
                        "final", records(), threads=2)
    assert rec["hub"]["deleted"] == ["model.safetensors"]
    assert rec["hub"]["commit"] == other.heads["main"] != before
    held = other.files("main")
    assert set(held) == set(rec["files"]) | {".gitattributes"} and "report/index.html" in held
    assert all(_sha(held[n]) == f["sha256"] for n, f in rec["files"].items())
    _token_nowhere(tmp_path)


@pytest.fixture
def released(run_copy, hub_env, tiny_hy3_dir, tmp_path):
    """The final release built and pushed once: (cfg.release.hub, its directory, record)."""
    _, layout, records = run_copy
    cfg = _hub_cfg(tmp_path / "run", tiny_hy3_dir)
    rec = release.build(cfg, layout, "final", records(), threads=2)
    return cfg.release.hub, Path(rec["dir"]), rec


def _upload(hub_cfg, folder: Path, rec: dict, tag: str = "final") -> dict:
    return release.upload(hub_cfg, tag, folder, rec["files"], message="test")


def test_pushing_the_same_release_again_is_accepted_and_pushes_nothing(released, hub_env):
    hub_cfg, folder, rec = released
    repo = hub_env.repos[HUB_REPO]
    commits = len(repo.commits)
    again = _upload(hub_cfg, folder, rec)
    assert again["commit"] == rec["hub"]["commit"] and again["pushed"] == 0
    assert len(repo.commits) == commits


def test_a_changed_file_is_other_content(released, hub_env):
    """The revision holds the release's names, one with other bytes: refused by name."""
    hub_cfg, folder, rec = released
    repo = hub_env.repos[HUB_REPO]
    repo.commit("main", {**repo.files(), "config.json": b"{}"}, "edited on the hub")
    with pytest.raises(release.ReleaseError, match="config.json \\(2 bytes"):
        _upload(hub_cfg, folder, rec)


def test_a_visibility_unlike_the_config_is_refused(run_copy, hub_env, tiny_hy3_dir, tmp_path,
                                                   released):
    hub_cfg, folder, rec = released
    public = dataclasses.replace(hub_cfg, private=False)
    with pytest.raises(release.ReleaseError,
                       match=f"{HUB_REPO}.*exists and is private, release.hub.private is "
                             "false"):
        _upload(public, folder, rec)


def test_a_new_branch_is_made_from_main(released, hub_env):
    """revision v2: a new branch; it starts from main, which holds this same release."""
    hub_cfg, folder, rec = released
    repo = hub_env.repos[HUB_REPO]
    got = _upload(dataclasses.replace(hub_cfg, revision="v2"), folder, rec)
    assert got["revision"] == "v2" and repo.heads["v2"] == repo.heads["main"] == got["commit"]


def test_a_failed_commit_fails_naming_the_repo_without_the_token(released, hub_env, tmp_path):
    hub_cfg, folder, rec = released
    hub_env.refuse_commit = (500, "storage is down ({auth})")  # a hub echoing the header
    with pytest.raises(release.ReleaseError, match="release.hub.repo hy3rl-test/fresh") as exc:
        _upload(dataclasses.replace(hub_cfg, repo="hy3rl-test/fresh"), folder, rec)
    assert "the upload failed" in str(exc.value) and "storage is down" in str(exc.value)
    assert TOKEN not in str(exc.value) and "(Bearer [REDACTED])" in str(exc.value)
    assert not hub_env.repos["hy3rl-test/fresh"].files().keys() - {".gitattributes"}


def test_a_commit_that_does_not_hold_the_release_is_refused(released, hub_env):
    """The hub's commit lacks a file the release pushed: read back, refused by name."""
    hub_cfg, folder, rec = released
    hub_env.lose_in_commit = {"config.json"}
    with pytest.raises(release.ReleaseError,
                       match="release.hub.repo hy3rl-test/fresh .*does not hold the release "
                             "as pushed: config.json missing"):
        _upload(dataclasses.replace(hub_cfg, repo="hy3rl-test/fresh"), folder, rec)


def test_an_upload_while_offline_is_refused_naming_the_repo(released, hub_env, monkeypatch):
    hub_cfg, folder, rec = released
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(release.ReleaseError, match=f"release.hub.repo {HUB_REPO} .*"
                                                   "HF_HUB_OFFLINE is set"):
        _upload(hub_cfg, folder, rec)


def test_an_upload_without_a_token_fails_naming_the_repo(released, hub_env, monkeypatch):
    hub_cfg, folder, rec = released
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(release.ReleaseError, match="release.hub.repo hy3rl-test/fresh.*401"):
        _upload(dataclasses.replace(hub_cfg, repo="hy3rl-test/fresh"), folder, rec)
    assert "hy3rl-test/fresh" not in hub_env.repos


def test_a_token_that_would_reach_release_json_is_refused(run_copy, hub_env, tiny_hy3_dir,
                                                          tmp_path, monkeypatch):
    """HF_TOKEN pasted into the config (here: the repository's name): release.json is not
    written."""
    _, layout, records = run_copy
    monkeypatch.setenv("HF_TOKEN", "hf_pastedTokenAsRepoName01")
    cfg = _cfg(tmp_path / "run", tiny_hy3_dir, hub={"repo": "me/hf_pastedTokenAsRepoName01"})
    with pytest.raises(release.ReleaseError, match="would contain HF_TOKEN"):
        release.build(cfg, layout, "final", records(), threads=2)
    assert not Path(layout.release_record("final")).exists()


@pytest.mark.parametrize(("hub", "key"), [
    ({"private": False}, "release.hub: 'repo' is a required property"),
    ({"repo": "no-slash"}, "release.hub.repo: 'no-slash' does not match"),
    ({"repo": "me/a--b"}, "release.hub.repo: 'me/a--b' is not a hub repository id"),
    ({"repo": "me/{run}"}, "release.hub.repo: 'me/{run}' has a brace"),
    ({"repo": "me/x", "revision": "a..b"}, "release.hub.revision: 'a..b' is not a branch"),
    ({"repo": "me/x", "overwrite": "yes"}, "release.hub.overwrite: 'yes' is not of type"),
])
def test_a_bad_hub_config_is_refused_by_key(hub, key):
    from hy3rl.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(key)):
        make_config(release={"hub": hub})


def test_two_tags_to_one_revision_are_refused_naming_release_hub():
    cfg = make_config(cluster={"gpu": True}, eval={"steps": [2]},
                      release={"hub": {"repo": "me/x"}})
    with pytest.raises(release.ReleaseError, match="release.hub: releases selected, final"):
        release.release_tags(cfg)
    per_tag = make_config(cluster={"gpu": True}, eval={"steps": [2]},
                          release={"hub": {"repo": "me/x-{tag}"}})
    assert release.release_tags(per_tag) == ["selected", "final"]
    assert per_tag.release.hub.at("final") == ("me/x-final", "main")
    one = make_config(cluster={"gpu": True}, eval={"steps": [2]},
                      release={"tags": ["final"], "hub": {"repo": "me/x"}})
    assert release.release_tags(one) == ["final"]


def _page(run_copy, tags=("selected", "final")) -> Path:
    """Release ``tags`` through the rule's entry point, then write their page."""
    from hy3rl.report import releases

    cfg, layout, _ = run_copy
    inputs = {"val": layout.data_val, "summary": layout.eval_summary, "plan": layout.train_plan,
              "train_done": layout.train_done, "selected": layout.eval_selected,
              "report": layout.report_html}
    for tag in tags:
        release.run(cfg, tag, inputs=inputs, out=Path(layout.release_record(tag)), threads=2)
    out = Path(layout.releases_page)
    releases.run(cfg, list(tags), layout=layout, out=out, env={})
    return out


def test_the_releases_page_shows_each_release_with_its_checks_and_the_report_links_it(
        run_copy):
    """report/releases.html (rule release_page): each release's directory, its checks with
    their details, file hashes and greedy answers; the report links it, saying when it was
    not written yet."""
    from hy3rl import report

    cfg, layout, _ = run_copy
    before = report.build(cfg, layout, {})["index.html"].decode()
    assert 'href="releases.html"' in before and "Not written yet" in before
    page = _page(run_copy).read_text()
    for tag in ("selected", "final"):
        rec = json.loads(Path(layout.release_record(tag)).read_text())
        assert f'id="release-{tag}"' in page and rec["dir"] in page
        for name, meta in rec["files"].items():
            assert f"<code>{name}</code>" in page and meta["sha256"] in page
        assert rec["generated"][0]["response"][:20].replace("<", "&lt;") in page
    assert page.count('<td class="status-pass">pass</td>') == 2 * 12  # 12 checks a release
    assert "step 2 (evaluated as <code>step2</code>)" in page
    assert "not uploaded" in page and 'href="index.html"' in page
    after = report.build(cfg, layout, {})["index.html"].decode()
    assert 'href="releases.html"' in after and "Not written yet" not in after


def test_the_releases_page_refuses_records_that_disagree(run_copy):
    """The page claims no more than the records hold: checks.json of a later refused attempt,
    checks of another release, a released file gone or truncated: each refused naming the
    file, and no page written."""
    from hy3rl.report import releases

    cfg, layout, _ = run_copy
    out = _page(run_copy, ("final",))
    out.unlink()
    checks = Path(layout.release_checks("final"))
    good = checks.read_text()

    def refused(match: str) -> None:
        with pytest.raises(releases.ReleasePageError, match=match):
            releases.run(cfg, ["final"], layout=layout, out=out, env={})
        assert not out.exists()

    doc = json.loads(good)
    doc["ok"] = False
    next(c for c in doc["checks"] if c["name"] == "inventory")["status"] = "fail"
    checks.write_text(json.dumps(doc))
    refused(r"checks\.json: a refused release attempt of final \(failed: inventory\)")
    doc = json.loads(good)
    doc["counts"]["pass"] -= 1
    checks.write_text(json.dumps(doc))
    refused(r"checks\.json: counts .* differ from .*release\.json")
    checks.write_text(good)
    dest = layout.release_model("final")
    shard = dest / "model-00002-of-00003.safetensors"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 1)
    refused(r"model-00002-of-00003\.safetensors: \d+ bytes, recorded \d+")
    (dest / "README.md").unlink()
    refused(r"README\.md: missing")
    Path(layout.release_record("final")).unlink()
    refused(r"release\.json: missing \(release final\)")


@pytest.mark.parametrize(("key", "value"), [
    ("architectures", ["LlamaForCausalLM"]), ("torch_dtype", "float32"),
    ("num_experts_per_tok", 1), ("rope_theta", 12345.0), ("router_scaling_factor", 9.0)])
def test_a_config_changed_after_the_evaluation_is_refused_naming_the_key(run_copy, key,
                                                                         value):
    """Issue 42: config.json was checked by nothing (it came with the checkpoint, the
    evaluation hashed only the weights): a changed architecture, dtype, expert count, rope
    or router scale passed every check. Now `evaluated` names the key that differs from the
    file the evaluation loaded, and `config` names it against the base's."""
    cfg, layout, _ = run_copy
    conf = layout.checkpoint_hf_model(3) / "config.json"
    doc = json.loads(conf.read_text())
    doc[key] = value
    conf.write_text(json.dumps(doc))
    failed = _refused(run_copy)
    assert {"evaluated", "config"} <= set(failed), failed
    assert f"config.json: key(s) {key} differ from the file evaluated" in \
        _problems(failed["evaluated"])
    assert f"config.json {key}: {json.dumps(value)}" in _problems(failed["config"])


def test_a_config_key_the_run_may_change_is_named_not_refused(run_copy, tiny_hy3_dir):
    """A key changed on purpose (release.config_may_differ) and evaluated so passes, named
    in the check's details; the same change not declared is refused."""
    cfg, layout, records = run_copy
    conf = layout.checkpoint_hf_model(3) / "config.json"
    doc = json.loads(conf.read_text())
    doc["rope_theta"] = 20000.0
    conf.write_text(json.dumps(doc))
    _evaluated_as_now(layout, "final", conf.parent)
    failed = _refused(run_copy)
    assert set(failed) == {"config"} and "rope_theta: 20000.0" in _problems(failed["config"])
    cfg2 = _cfg(Path(layout.results_root).parent, tiny_hy3_dir,
                config_may_differ=["rope_theta"])
    release.build(cfg2, layout, "final", records(), threads=2)
    checks = json.loads(Path(layout.release_checks("final")).read_text())["checks"]
    config = next(c for c in checks if c["name"] == "config")
    assert config["status"] == "pass" and "rope_theta (allowed)" in config["details"]


def test_a_tokenizer_normalizer_changed_after_the_evaluation_is_refused(run_copy):
    """Issue 42: the shipped tokenizer's normalizer changed after the evaluation (the
    evaluated tokenizer gave 16 ids for a prompt, the shipped one 19): `evaluated` names the
    key, `encodings` the prompts the release's tokenizer reads otherwise."""
    cfg, layout, _ = run_copy
    tok = layout.checkpoint_hf_model(3) / "tokenizer.json"
    doc = json.loads(tok.read_text())
    doc["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "  "}
    tok.write_text(json.dumps(doc))
    failed = _refused(run_copy)
    assert {"evaluated", "encodings"} <= set(failed), failed
    assert "tokenizer.json: key(s) normalizer differ from the file evaluated" in \
        _problems(failed["evaluated"])
    assert "problem 0: " in _problems(failed["encodings"])
    assert "token ids from the release's tokenizer" in _problems(failed["encodings"])


def test_a_generation_config_changed_after_the_evaluation_is_refused(run_copy):
    """Issue 42: generation_config.json (vLLM's and transformers' default stop tokens and
    sampling) was the base's, never the one evaluated: now the evaluated file is shipped and
    a change after the evaluation is named by key."""
    cfg, layout, _ = run_copy
    gen = layout.checkpoint_hf_model(3) / "generation_config.json"
    doc = json.loads(gen.read_text())
    doc["eos_token_id"] = 7
    gen.write_text(json.dumps(doc))
    failed = _refused(run_copy)
    assert set(failed) == {"evaluated"}, failed
    assert "generation_config.json: key(s) eos_token_id differ from the file evaluated" in \
        _problems(failed["evaluated"])
