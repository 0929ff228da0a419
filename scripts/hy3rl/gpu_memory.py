"""Every GPU of a node sampled with ``nvidia-smi`` while a job runs (issue 43): the peak
``memory.used`` of each GPU, which verl's own metrics cannot give (it logs the memory of
one rank per data-parallel group: the rehearsal's stage at CP 8 shows one GPU of eight).

``memory.used`` is the device's whole use (every process on it: Megatron, vLLM, the
CUDA contexts), the figure an out-of-memory is about; torch's ``max_memory_reserved`` is
one process's allocator. :class:`Sampler` runs ``nvidia-smi --query-gpu=index,uuid,
memory.used,memory.total --format=csv,noheader,nounits`` every ``interval_s`` in a thread
and keeps each GPU's peak and when it was seen; a peak between two samples is missed (the
figure is a floor). Without ``nvidia-smi`` (this workplace, a CPU node) it samples nothing
and says why. Standard library only.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

QUERY = ("--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits")
MIB = 2**20  # nvidia-smi's memory figures are MiB


class SampleError(Exception):
    """nvidia-smi did not give the figures (its message)."""


def parse(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi`` query lines -> ``[{"index", "uuid", "used_mib", "total_mib"}]``;
    raises :class:`SampleError` naming a line it cannot read."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        try:
            index, uuid, used, total = parts
            out.append({"index": int(index), "uuid": uuid, "used_mib": float(used),
                        "total_mib": float(total)})
        except ValueError:
            raise SampleError(f"nvidia-smi line not index, uuid, memory.used, memory.total: "
                              f"{line.strip()[:200]!r}") from None
    if not out:
        raise SampleError("nvidia-smi listed no GPU")
    return out


def sample(smi: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """One sample of every GPU (:func:`parse`), bounded by ``timeout_s``."""
    try:
        proc = subprocess.run([smi, *QUERY], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SampleError(f"{smi}: {exc}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SampleError(f"{smi} exited {proc.returncode}: {tail[0][:200]}")
    return parse(proc.stdout)


class Sampler:
    """Each GPU's peak ``memory.used`` while it runs (module doc); :meth:`stop` returns the
    record: ``gpus`` (per GPU ``index``, ``uuid``, ``peak_mib``, ``total_mib``,
    ``peak_s``: seconds after the start), ``samples``, ``interval_s``, ``errors`` (the
    first few, with their count), ``not_run`` (why nothing was sampled, else None)."""

    MAX_ERRORS = 5

    def __init__(self, interval_s: float = 1.0, smi: str | None = None) -> None:
        self.interval_s = interval_s
        self.smi = smi or shutil.which("nvidia-smi")
        self.gpus: dict[int, dict[str, Any]] = {}
        self.samples = 0
        self.errors: list[str] = []
        self.error_count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-memory", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> Sampler:
        self._t0 = time.monotonic()
        if self.smi:
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.take()
            self._stop.wait(self.interval_s)

    def take(self) -> None:
        """One sample into the peaks (an error is counted, the first few kept)."""
        try:
            rows = sample(self.smi or "nvidia-smi", timeout_s=max(5.0, self.interval_s))
        except SampleError as exc:
            self.error_count += 1
            if len(self.errors) < self.MAX_ERRORS:
                self.errors.append(str(exc))
            return
        now = round(time.monotonic() - self._t0, 1)
        self.samples += 1
        for r in rows:
            g = self.gpus.setdefault(r["index"], {"index": r["index"], "uuid": r["uuid"],
                                                  "peak_mib": -1.0, "total_mib": r["total_mib"],
                                                  "peak_s": None})
            if r["used_mib"] > g["peak_mib"]:
                g["peak_mib"], g["peak_s"] = r["used_mib"], now

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(10.0, 2 * self.interval_s))
        not_run = None
        if not self.smi:
            not_run = "not run: nvidia-smi not found on this node"
        elif not self.samples:
            not_run = "not run: no sample: " + ("; ".join(self.errors) or "stopped at once")
        return {"gpus": [self.gpus[i] for i in sorted(self.gpus)], "samples": self.samples,
                "interval_s": self.interval_s, "errors": self.errors,
                "error_count": self.error_count, "not_run": not_run,
                "query": f"nvidia-smi {' '.join(QUERY)}"}


def judge(record: Mapping[str, Any] | None, limit_gb: float) -> tuple[list[str], str]:
    """Each GPU's peak ``memory.used`` in a :class:`Sampler` record (every process on the
    device, vLLM's included) against ``limit_gb``: the problems (a GPU above it, named) and
    the figure (the largest GPU, or why the node was not sampled)."""
    if not record:
        return [], ""
    if record.get("not_run") or not record.get("gpus"):
        return [], (f"; the node's GPUs not sampled ({record.get('not_run') or 'no GPU'}): "
                    "one GPU a data-parallel group judged")
    gpus = [{**g, "peak_gb": g["peak_mib"] * MIB / 1e9} for g in record["gpus"]]
    top = max(gpus, key=lambda g: g["peak_gb"])
    how = f"nvidia-smi memory.used, {record['samples']} samples every {record['interval_s']:g} s"
    problems = [f"GPU {g['index']} of the node ({g['uuid']}) peaked at {g['peak_gb']:.1f} GB "
                f"at {g['peak_s']:g} s ({how}), above {limit_gb:.1f} GB"
                for g in gpus if g["peak_gb"] > limit_gb]
    return problems, (f"; the node's {len(gpus)} GPUs ({how}): GPU {top['index']} the largest "
                      f"at {top['peak_gb']:.1f} GB")
