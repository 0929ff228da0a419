"""Benchmark: check_checkpoint on a checkpoint with Hy3's real tensor inventory.

Builds (in a temporary directory) 99 safetensors shards holding Hy3's 47,138 tensors in
their on-disk names, dtypes and shapes (from Hy3's config values), with real headers and
an index; the data regions are sparse (``truncate``), so the 598 GB cost no disk, except
the 80 F32 expert biases, written for real. Then prints:

- the header-only check (``hy3rl.checkpoint.check_checkpoint``, all checks but the manifest
  and the bridge import attempt), target < 5 s on 2 cores;
- a naive check through safetensors: ``safe_open`` every shard and ``get_slice`` every
  tensor for dtype/shape (full), and ``get_tensor`` every tensor (measured on a few
  shards and extrapolated: it reads all 598 GB).

Run: ``.venv/bin/python benchmarks/bench_checkpoint.py [--lock results/<run>/deps/lock.json]
[--naive-tensor-shards 1]``. Without --lock the bridge table is read from the bridge-shaped
test file in tests/fixtures/checkpoint.py committed into a temporary git repository.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from hy3rl import checkpoint as ck
from hy3rl import hub
from hy3rl.atomic import write_json_atomic
from hy3rl.bridge_source import BridgeSource, bridge_source_from_lock
from hy3rl.layout import Layout
from hy3rl.timefmt import utc_now

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test fixtures' bridge-shaped file

HY3_CONFIG = {  # Hy3 (upstream-facts: architecture of tencent/Hy3)
    "architectures": ["HYV3ForCausalLM"], "model_type": "hy_v3",
    "vocab_size": 120832, "hidden_size": 4096, "intermediate_size": 13312,
    "moe_intermediate_size": 1536, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "num_experts": 192, "num_experts_per_tok": 8,
    "num_shared_experts": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}
HY3_TENSORS, HY3_SHARDS, HY3_TOTAL_SIZE = 47_138, 99, 597_572_342_272


def build_sparse_hy3(out: Path, shards: int = HY3_SHARDS) -> dict:
    ms, problems = ck.model_shape(HY3_CONFIG)
    assert ms and not problems, problems
    inv = ck.expected_inventory(ms)
    names = sorted(inv, key=lambda n: [int(p) if p.isdigit() else p
                                       for p in n.replace(".", " . ").split()])
    size = {n: ck.DTYPE_SIZES[inv[n].dtype] * _numel(inv[n].shape) for n in names}
    total = sum(size.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for n in names:
        groups[min(shards - 1, acc * shards // total)].append(n)
        acc += size[n]
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for n in group:
            header[n] = {"dtype": inv[n].dtype, "shape": list(inv[n].shape),
                         "data_offsets": [pos, pos + size[n]]}
            pos += size[n]
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(out / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(blob)) + blob)
            for n in group:
                if n.endswith("mlp.expert_bias"):  # real, non-zero F32 values
                    layer = int(n.split(".")[2])
                    fh.seek(8 + len(blob) + header[n]["data_offsets"][0])
                    fh.write(struct.pack("<192f", *[0.01 * (1 + (layer + e) % 7)
                                                    for e in range(192)]))
            fh.truncate(8 + len(blob) + pos)  # sparse: no disk for the weights
        weight_map.update(dict.fromkeys(group, fname))
    (out / "config.json").write_text(json.dumps(HY3_CONFIG, indent=2))
    (out / ck.INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return {"tensors": len(names), "shards": shards, "total_size": total}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def bridge_source(args, tmp: Path) -> tuple[BridgeSource | None, str]:
    if args.lock:
        return bridge_source_from_lock(Path(args.lock))
    from fixtures.checkpoint import BRIDGE_PATH, FAKE_BRIDGE
    from fixtures.common import make_git_repo

    clone = tmp / "megatron_bridge"
    head = make_git_repo(clone, {BRIDGE_PATH: FAKE_BRIDGE})
    return BridgeSource(clone, head), ""


def naive_slices(model: Path) -> int:
    from safetensors import safe_open

    count = 0
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                s = f.get_slice(k)
                count += int(bool(s.get_dtype()) and s.get_shape() is not None)
    return count


def naive_tensors(model: Path, n_shards: int) -> tuple[float, int]:
    from safetensors import safe_open

    t0, count = time.perf_counter(), 0
    for shard in sorted(model.glob("*.safetensors"))[:n_shards]:
        with safe_open(shard, framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                t = f.get_tensor(k)
                count += int(t.dtype is not None and t.dim() >= 0)
                del t
    return time.perf_counter() - t0, count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lock", help="deps lock.json: read the pinned hy_v3_bridge.py")
    ap.add_argument("--naive-tensor-shards", type=int, default=1,
                    help="shards to read fully with get_tensor (then extrapolated)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-hy3-") as tmp:
        tmp_path = Path(tmp)
        model = tmp_path / "hy3"
        t0 = time.perf_counter()
        built = build_sparse_hy3(model)
        t_build = time.perf_counter() - t0
        disk = int(subprocess.run(["du", "-sk", str(model)], capture_output=True,
                                  text=True).stdout.split()[0])
        print(f"built {built['tensors']:,} tensors in {built['shards']} shards, total_size "
              f"{built['total_size']:,} B (apparent), {disk / 1024:.1f} MiB on disk, "
              f"{t_build:.1f} s")
        assert built["tensors"] == HY3_TENSORS, built
        assert built["total_size"] == HY3_TOTAL_SIZE, built
        source, why = bridge_source(args, tmp_path)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            results, _ = ck.check_checkpoint(model, source, why, threads=os.cpu_count() or 2,
                                             try_import=False)
            times.append(time.perf_counter() - t0)
        status = {r.name: r.status for r in results}
        bad = {n: s for n, s in status.items() if s == "fail"}
        print(f"header-only check_checkpoint: best {min(times):.2f} s, median "
              f"{sorted(times)[len(times) // 2]:.2f} s over {args.repeat} runs "
              f"(target < 5 s); statuses {status}")
        if bad:
            for r in results:
                if r.status == "fail":
                    print(f"  FAIL {r.name}: {r.details} {r.problems[:3]}")
        # The console script on the run's layout: results/<run>/deps/lock.json -> checks/.
        layout = Layout(str(tmp_path / "results"), "bench")
        lock = Path(layout.deps_lock)
        lock.parent.mkdir(parents=True)
        if source is not None:
            lock.write_text(json.dumps({"repos": {"megatron_bridge": {
                "path": str(source.clone), "head": source.commit}}}))
        # Rule model's manifest with the real sizes (sha256 is off: no hash is compared,
        # and hashing the sparse 598 GB would time the disk, not the check).
        files = [hub.FileEntry(rel, (model / rel).stat().st_size, sha256="0" * 64)
                 for rel in hub.list_files(model)]
        write_json_atomic(layout.model_manifest, hub.Manifest(
            hub.Source("local", path=str(model.resolve())), str(model.resolve()),
            utc_now(), files).to_dict())
        cfg = tmp_path / "bench.yaml"
        cfg.write_text(yaml.safe_dump({
            "run": {"name": layout.run, "results_root": layout.results_root},
            "model": {"source": str(model)},
            "checks": {"checkpoint": {"sha256": False, "threads": os.cpu_count() or 2}}}))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "hy3rl.cli", "check_checkpoint", "--configfile",
             str(REPO / "config" / "config.yaml"), "--configfile", str(cfg)],
            capture_output=True, text=True, cwd=tmp_path)
        print(f"CLI hy3rl check_checkpoint (process start, imports, import attempt, "
              f"report): {time.perf_counter() - t0:.2f} s, exit {proc.returncode}")
        t0 = time.perf_counter()
        n = naive_slices(model)
        t_slices = time.perf_counter() - t0
        print(f"naive safetensors safe_open + get_slice of all {n:,} tensors: {t_slices:.2f} s "
              "(dtype/shape only, no config, index or bridge checks)")
        if args.naive_tensor_shards > 0:
            t, count = naive_tensors(model, args.naive_tensor_shards)
            per = t / args.naive_tensor_shards
            print(f"naive safetensors get_tensor of every tensor: {t:.1f} s for "
                  f"{args.naive_tensor_shards} shard(s) / {count} tensors, extrapolated "
                  f"{per * built['shards']:.0f} s for {built['shards']} shards (reads all "
                  f"{built['total_size'] / 1e9:.0f} GB; sparse zeros here, storage speed on a "
                  "real copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
