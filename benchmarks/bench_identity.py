"""Benchmark: what the run identity from the composed configuration (issue 40) adds to
preflight on the paper config.

Checks out the pinned verl from its local mirror (``HY3RL_VERL_MIRROR``, default
``/work/.mirror/verl-project+verl/repo``) into a temporary directory, resolves the paper
config against it (``hy3rl.preflight.resolve.resolve``: the launch script's argument list and
Hydra's composition, which preflight runs anyway), then times, ``--repeat`` times each, the
identity's own work on the composed config: its leaves resolved
(``hy3rl.identity.composed_leaves``), the trajectory (``composed_trajectory``) and rule
owned_keys. Prints the best seconds of each, their sum against the target (under 5 s added
to preflight), and, for scale, one composition.

Run: ``.venv/bin/python benchmarks/bench_identity.py [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from hy3rl import config as cfgmod  # noqa: E402
from hy3rl import identity  # noqa: E402
from hy3rl.layout import Layout  # noqa: E402
from hy3rl.preflight import rules  # noqa: E402
from hy3rl.preflight.resolve import compose, resolve  # noqa: E402
from hy3rl.settings import Config  # noqa: E402

TARGET_S = 5.0
MIRROR = os.environ.get("HY3RL_VERL_MIRROR", "/work/.mirror/verl-project+verl/repo")


def best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        raw = cfgmod.load(REPO / "config/config.yaml", REPO / "config/paper.yaml")
        pin = raw["deps"]["repos"]["verl"]["commit"]
        verl = tmp / "verl"
        subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", MIRROR, str(verl)],
                       check=True)
        subprocess.run(["git", "-C", str(verl), "checkout", "-q", pin], check=True)
        raw["train"]["checkpoint_root"] = str(tmp / "ckpt")
        raw["run"]["results_root"] = str(tmp / "results")
        (tmp / "model").mkdir()
        raw["model"].update(source=str(tmp / "model"), revision=None)
        cfg = Config.from_dict(raw)
        res = resolve(cfg, verl, train_files=tmp / "train.parquet", val_files=tmp / "v.parquet",
                      val_n=None, checkpoint_dir=Layout.from_config(raw).checkpoint_dir,
                      reward_fn=tmp / "reward.py")
        if res.compose_error:
            print(f"the paper config does not compose: {res.compose_error}")
            return 1
        texts = [o.text for o in res.overrides]
        t_compose, _ = best(lambda: compose(res.config_dir, res.config_name, texts), 1)
        t_leaves, leaves = best(lambda: identity.composed_leaves(res.composed), args.repeat)
        spelled = [(o.key, o.origin) for o in res.overrides]

        def trajectory():
            origins = {k: o for k in leaves if (o := identity.origin_of(k, spelled))}
            return identity.composed_trajectory(
                leaves, pins={"verl": pin}, owned={}, train_sha256="x", model="y",
                reward_fn_sha256=None, origins=origins)

        t_traj, traj = best(trajectory, args.repeat)

        def owned():
            r = rules._Rules()
            rules._owned_keys(r, res)
            return r

        t_owned, _ = best(owned, args.repeat)
    total = t_leaves + t_traj + t_owned
    print(f"paper config: {len(leaves)} composed leaves, {len(traj['values'])} in the "
          f"trajectory, {len(res.overrides)} overrides")
    print(f"  composition (preflight runs it anyway): {t_compose:7.3f} s")
    print(f"  leaves, resolved:                       {t_leaves:7.3f} s")
    print(f"  trajectory (with origins):              {t_traj:7.3f} s")
    print(f"  rule owned_keys:                        {t_owned:7.3f} s")
    print(f"identity added to preflight: {total:.3f} s (target < {TARGET_S:.0f} s: "
          f"{'met' if total < TARGET_S else 'MISSED'})")
    return 0 if total < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
