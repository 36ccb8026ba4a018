"""SLURM on one machine, for the launch recipes' tests: stand-in `scontrol` and `srun`
commands, and the environment `sbatch` gives a batch script.

- `scontrol show hostnames LIST` prints a comma-separated node list one name a line (the
  tests name nodes by loopback addresses, 127.0.0.2, 127.0.0.3, ..., which all reach this
  machine); `scontrol requeue JOB` appends `requeue JOB` to `<dir>/scontrol.log`.
- `srun [--nodelist=A,B] CMD ...` runs CMD once per node of the step (default: every node of
  the job), all at once, as SLURM does, each with that node's SLURM_NODEID (its index in the
  job), SLURM_PROCID (its task's index in the step, one task per node) and SLURMD_NODENAME;
  it forwards SIGTERM/SIGINT to them (srun forwards signals to its tasks) and exits with the
  highest task exit status. Every call is appended to `<dir>/srun.log`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SCONTROL = """
case "$1" in
    show) [[ "$2" == hostnames ]] && tr ',' '\\n' <<<"$3" ;;
    requeue) echo "requeue $2" >>"$HERE/scontrol.log" ;;
    *) echo "scontrol stand-in: $*: not simulated" >&2; exit 1 ;;
esac
"""

SRUN = """
step_nodes="$SLURM_JOB_NODELIST"
while [[ "$1" == -* ]]; do
    case "$1" in --nodelist=*) step_nodes="${1#--nodelist=}" ;; esac
    shift
done
echo "$step_nodes: $*" >>"$HERE/srun.log"
mapfile -t job < <(tr ',' '\\n' <<<"$SLURM_JOB_NODELIST")
mapfile -t step < <(tr ',' '\\n' <<<"$step_nodes")
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM INT
for i in "${!step[@]}"; do
    node=-1
    for j in "${!job[@]}"; do if [[ "${job[j]}" == "${step[i]}" ]]; then node=$j; fi; done
    SLURM_NODEID=$node SLURM_PROCID=$i SLURMD_NODENAME="${step[i]}" "$@" &
    pids+=($!)
done
code=0
for pid in "${pids[@]}"; do
    while true; do
        rc=0
        wait "$pid" || rc=$?
        if ! kill -0 "$pid" 2>/dev/null; then break; fi
    done
    if ((rc > code)); then code=$rc; fi
done
exit "$code"
"""


def write_stand_ins(directory: Path) -> Path:
    """`scontrol` and `srun` stand-ins in `directory` (put it first on PATH); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, body in {"scontrol": SCONTROL, "srun": SRUN}.items():
        path = directory / name
        path.write_text(
            f'#!/usr/bin/env bash\nset -euo pipefail\nHERE="{directory}"\n{body.lstrip()}'
        )
        path.chmod(0o755)
    return directory


# What a test's own environment may hold that a batch script must not find: a launch
# variable set here would hide a recipe that forgot to set it.
NOT_FROM_SBATCH = (
    "NODE_RANK",
    "NNODES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GPUS_PER_NODE",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "PYTHON",
    "PYTHONPATH",
    "RLHF_SGLANG_API_KEY",
    "SLURM_RESTART_COUNT",
)


def sbatch_environment(
    stand_ins: Path, nodes: list[str], submit_dir: Path, job_id: int, **exported: str
) -> dict[str, str]:
    """The environment `sbatch --nodes=len(nodes) --gpus-per-node=1` gives its batch script:
    the submitter's (an activated virtualenv: VIRTUAL_ENV, its bin first on PATH; plus
    `exported`, e.g. ports the submitter chose) and SLURM's variables; nothing per node."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_FROM_SBATCH}
    venv = Path(sys.executable).parent
    path = os.pathsep.join([str(stand_ins), str(venv), env.get("PATH", "")])
    return {
        **env,
        "PATH": path,
        "VIRTUAL_ENV": str(venv.parent),
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": "rlhf",
        "SLURM_JOB_NODELIST": ",".join(nodes),
        "SLURM_NODELIST": ",".join(nodes),
        "SLURM_NNODES": str(len(nodes)),
        "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_GPUS_PER_NODE": "1",
        "SLURM_SUBMIT_DIR": str(submit_dir),
        "SLURM_SUBMIT_HOST": nodes[0],
        "SLURMD_NODENAME": nodes[0],  # the batch script runs on the first node
        **exported,
    }
