"""Snakemake's own command line for the tests (``fixtures.common.SNAKEMAKE``), with one
change: a remote executor (the SLURM plugin) sleeps at most :data:`POLL_CAP_S` seconds
between two rounds of status checks.

snakemake-executor-plugin-slurm 2.8 waits ``slurm-init-seconds-before-status-checks``
after a round in which a job ended and 10 s more after each round in which none did, up
to 180 s (``Executor.check_active_jobs``). Right on a production cluster, whose jobs run
for hours and whose slurmctld is shared; on the test cluster, whose jobs last seconds to
minutes, that back-off was most of a test's wall time (a job that ran 2 minutes was seen
ended up to a minute later, and a test waits for several such jobs in a row). Only the
cadence changes: what is queried (``squeue``, the test profile's
``slurm-status-command``), how a state is read and what Snakemake does with it stay the
plugin's own. Jobs inside SLURM run the unchanged ``python -m snakemake``.

    python tests/snakemake_cli.py <snakemake arguments>
"""

from __future__ import annotations

import asyncio
import os

from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

POLL_CAP_S = float(os.environ.get("HY3RL_TEST_STATUS_POLL_S", "2"))


async def _capped_sleep(self: RemoteExecutor) -> None:
    await asyncio.sleep(min(self.next_seconds_between_status_checks, POLL_CAP_S))


RemoteExecutor.sleep = _capped_sleep  # type: ignore[method-assign]

if __name__ == "__main__":
    from snakemake.cli import main

    main()
