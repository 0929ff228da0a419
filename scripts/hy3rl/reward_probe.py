"""The live reward path, probed inside the training runtime (the rehearsal's check
``reward_path``; docs/formats/rehearsal.md).

The rehearsal's plan composes the run's verl config (preflight's overrides over the pinned
verl's Hydra tree). :func:`probe` composes it again on the rehearsal's host, takes one
training prompt (its ``data_source`` and ``reward_model.ground_truth``) and writes two
responses to it: a known-correct one (the ground truth as the answer, ``\\boxed{}`` and
``Answer:``) and a wrong one (another answer, same form). A subprocess of the training
runtime's python, with the pinned verl clone first on ``PYTHONPATH``, then builds the reward
manager exactly as verl's reward loop does (``verl.trainer.ppo.reward.load_reward_manager(
config, hf_tokenizer(model path))``: the registered manager, the custom reward function when
the plan sets ``reward.custom_reward_function``, verl's default ``compute_score`` otherwise)
and scores each response through its ``run_single`` on a one-row ``DataProto`` of the
tokenised prompt and response, as verl's ``RewardLoopWorker`` hands it a rollout. It is not
the workflow's own grader.

The check passes only when the correct response is scored correct and the wrong one wrong
(``acc`` where the manager reports it, else the sign of the score) and the correct one scores
higher. Where verl does not import, it is ``not run`` with the ImportError: never a pass.

This file is also the subprocess's runner (``python -P reward_probe.py --out FILE``, the
payload as JSON on stdin), so its module level imports the standard library only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"


# --------------------------------------------------------------------------- the host side


def training_prompt(train_files: Path) -> dict[str, Any]:
    """The first row of the training parquet with a ground truth: its ``data_source``,
    ``ground_truth``, the prompt's text and ``extra_info`` (verl's parquet columns)."""
    import pyarrow.parquet as pq

    table = pq.read_table(train_files, columns=["data_source", "prompt", "reward_model",
                                                "extra_info"])
    for i, row in enumerate(table.to_pylist()):
        gt = (row.get("reward_model") or {}).get("ground_truth")
        if gt not in (None, ""):
            prompt = row["prompt"]
            text = "\n".join(m.get("content", "") for m in prompt) if isinstance(
                prompt, list) else str(prompt)
            return {"row": i, "data_source": row["data_source"], "ground_truth": str(gt),
                    "prompt": text, "extra_info": row.get("extra_info") or {}}
    raise ValueError(f"{train_files}: no row with reward_model.ground_truth")


def wrong_answer(ground_truth: str) -> str:
    """An answer unlike the ground truth: the number plus one, else a different string."""
    try:
        return str(int(ground_truth.strip()) + 1)
    except ValueError:
        return "0" if ground_truth.strip() != "0" else "1"


def cases(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The two responses to the training prompt ``row``: correct and wrong."""
    def response(answer: str) -> str:
        return (f"Working through the problem gives \\boxed{{{answer}}}.\n"
                f"Answer: {answer}")

    return [{"name": name, "expect_correct": ok, "response": response(answer),
             "prompt": row["prompt"], "data_source": row["data_source"],
             "ground_truth": row["ground_truth"], "extra_info": row["extra_info"]}
            for name, ok, answer in (("correct", True, row["ground_truth"]),
                                     ("wrong", False, wrong_answer(row["ground_truth"])))]


def composed_config(plan: Mapping[str, Any]) -> Any:
    """The run's verl config as the plan composes it (its overrides, in order, over
    ``verl.config_dir``/``verl.config_name``), as a plain container (unresolved)."""
    from omegaconf import OmegaConf

    from hy3rl.preflight.resolve import compose

    verl = plan["verl"]
    cfg = compose(Path(verl["config_dir"]), verl["config_name"],
                  [o["text"] for o in plan["overrides"]])
    return OmegaConf.to_container(cfg, resolve=False)


def prepare(plan: Mapping[str, Any], *, model_dir: Path, train_files: Path
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The runner's payload (the model's path, the composed config, the two :func:`cases`)
    and the training row they answer."""
    row = training_prompt(train_files)
    payload = {"model_dir": str(Path(model_dir).absolute()), "composed": composed_config(plan),
               "cases": cases(row)}
    return payload, row


def run_runner(payload: Mapping[str, Any], *, verl_dir: Path, python: Sequence[str],
               timeout_s: float = 300) -> tuple[list[dict[str, Any]], str]:
    """This file as the runner in ``python`` (the training runtime's interpreter command)
    with ``verl_dir`` first on ``PYTHONPATH``: its JSON lines, and why it stopped early
    ("" when it exited 0)."""
    from hy3rl.verl_checks import verl_env

    env = verl_env(verl_dir)
    with tempfile.TemporaryDirectory(prefix="hy3rl-reward-probe-") as tmp:
        out = Path(tmp) / "scores.jsonl"
        cmd = [*python, "-P", str(Path(__file__).resolve()), "--out", str(out)]
        try:
            proc = subprocess.run(cmd, input=json.dumps(payload, default=str), cwd=tmp, env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
            stopped = "" if proc.returncode == 0 else (
                f"the probe exited {proc.returncode}: {_tail(proc.stderr)}")
        except subprocess.TimeoutExpired:
            stopped = f"the probe timed out after {timeout_s:g}s"
        except OSError as exc:
            stopped = f"the runtime's python could not start ({exc})"
        lines = [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []
    return lines, stopped


def probe(plan: Mapping[str, Any], *, model_dir: Path, train_files: Path,
          python: Sequence[str], timeout_s: float = 300) -> dict[str, Any]:
    """Score the two :func:`cases` through verl's reward manager in ``python`` (the
    training runtime's interpreter command), the plan's verl clone first on its path.
    Returns ``{"status", "detail", "cases"}``; never raises for what the runtime reports."""
    try:
        payload, row = prepare(plan, model_dir=model_dir, train_files=train_files)
        verl_dir = Path(plan["verl"]["path"])
    except Exception as exc:  # the inputs of the probe itself: a failure, named
        return {"status": FAIL, "detail": f"the probe could not be prepared: "
                f"{type(exc).__name__}: {exc}", "cases": []}
    lines, stopped = run_runner(payload, verl_dir=verl_dir, python=python, timeout_s=timeout_s)
    return judge(lines, stopped, row)


def _tail(text: str, n: int = 600) -> str:
    text = (text or "").strip()
    return text[-n:] if text else "(no output)"


def judge(lines: list[Mapping[str, Any]], stopped: str, row: Mapping[str, Any]
          ) -> dict[str, Any]:
    """The check's result from the runner's lines (``{"status": "not run", ...}`` or one
    ``{"case", "score", "acc"}`` a case, or ``{"error"}``)."""
    where = (f"training row {row['row']} ({row['data_source']}, ground truth "
             f"{row['ground_truth']!r})")
    for ln in lines:
        if ln.get("status") == NOT_RUN:
            return {"status": NOT_RUN, "detail": f"not run: {ln['reason']}", "cases": []}
        if "error" in ln:
            return {"status": FAIL, "detail": f"verl's reward path raised: {ln['error']}",
                    "cases": []}
    scored = {ln["case"]: ln for ln in lines if "case" in ln}
    if set(scored) != {"correct", "wrong"}:
        return {"status": FAIL, "detail": f"{where}: scored {sorted(scored)} of correct, "
                f"wrong" + (f"; {stopped}" if stopped else ""), "cases": list(scored.values())}
    problems = []

    def correct(ln: Mapping[str, Any]) -> bool:
        """verl's ``acc`` (a bool, or the score itself where the function returns a number)
        where reported, else the score's sign."""
        acc = ln.get("acc")
        return float(acc) > 0 if isinstance(acc, (bool, int, float)) else ln["score"] > 0

    c, w = scored["correct"], scored["wrong"]
    if not correct(c):
        problems.append("the correct response was scored wrong")
    if correct(w):
        problems.append("the wrong response was scored correct")
    if not c["score"] > w["score"]:
        problems.append("the correct response did not score above the wrong one")
    figure = (f"{where} through {c.get('manager')}: correct {c['score']:g} (acc "
              f"{c.get('acc')}), wrong {w['score']:g} (acc {w.get('acc')})")
    if problems:
        return {"status": FAIL, "detail": f"{figure}: {'; '.join(problems)}",
                "cases": [c, w]}
    return {"status": PASS, "detail": figure, "cases": [c, w]}


# --------------------------------------------------------------------------- the runner


def _batch(tokenizer: Any, case: Mapping[str, Any]) -> Any:
    """One rollout row as verl's reward loop receives it: prompt and response token ids, the
    attention mask over both, ``data_source``, ``reward_model``, ``extra_info``."""
    import numpy as np
    import torch
    from verl import DataProto

    prompt = torch.tensor(tokenizer.encode(case["prompt"], add_special_tokens=False) or [0])
    response = torch.tensor(tokenizer.encode(case["response"], add_special_tokens=False))
    ids = torch.cat([prompt, response])

    def obj(value: Any) -> Any:
        arr = np.empty(1, dtype=object)
        arr[0] = value
        return arr

    return DataProto.from_dict(
        tensors={"prompts": prompt[None], "responses": response[None], "input_ids": ids[None],
                 "attention_mask": torch.ones_like(ids)[None]},
        non_tensors={"data_source": obj(case["data_source"]),
                     "reward_model": obj({"ground_truth": case["ground_truth"],
                                          "style": "rule"}),
                     "extra_info": obj(dict(case["extra_info"]))})


def _run(payload: Mapping[str, Any], emit: Any) -> None:
    try:
        from omegaconf import OmegaConf
        from verl.trainer.ppo.reward import load_reward_manager
        from verl.utils import hf_tokenizer
    except ImportError as exc:
        emit({"status": NOT_RUN, "reason": f"verl's reward path does not import here "
              f"({type(exc).__name__}: {exc})"})
        return
    try:
        cfg = OmegaConf.create(payload["composed"])
        OmegaConf.resolve(cfg)
        tokenizer = hf_tokenizer(payload["model_dir"], trust_remote_code=True)
        manager = load_reward_manager(cfg, tokenizer, reward_router_address=None,
                                      reward_model_tokenizer=None)
        name = f"{type(manager).__name__} ({cfg.reward.reward_manager.name})"
        for case in payload["cases"]:
            result = manager.loop.run_until_complete(manager.run_single(_batch(tokenizer, case)))
            extra = result.get("reward_extra_info") or {}
            acc = extra.get("acc")
            acc = acc.item() if hasattr(acc, "item") else acc  # a numpy / torch scalar
            emit({"case": case["name"], "manager": name, "score": float(result["reward_score"]),
                  "acc": acc if isinstance(acc, (bool, int, float)) or acc is None
                  else str(acc),
                  "pred": str(extra.get("pred"))[:100] if "pred" in extra else None})
    except Exception as exc:  # verl raising on the plan's reward: the point of the probe
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        emit({"error": f"{type(exc).__name__}: {exc}{where}"})


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="score a correct and a wrong response through "
                                     "verl's reward manager (internal; payload on stdin)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    payload = json.load(sys.stdin)
    with open(args.out, "a") as out:
        def emit(doc: Mapping[str, Any]) -> None:
            out.write(json.dumps(doc, default=str) + "\n")
            out.flush()

        _run(payload, emit)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
