"""A real Slurm on loopback, for the Slurm tests: one ``slurmctld`` and
several ``slurmd -N nodeN`` on this host, each on a port of its own.

Everything private lives under one directory (slurm.conf, state, spools, pid
and log files); no munge (``AuthType=auth/none``, ``CredType=cred/none``),
no cgroups (``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``).
The daemons run in the foreground (``-D``) as this process's children and are
stopped by PID. Every node has the same ``hostname``: a task tells its node by
``SLURMD_NODENAME``. `env` is what a Slurm command (srun, sinfo, scontrol)
needs to talk to this cluster (``SLURM_CONF``).

Needs root (slurmd runs tasks as their user, and Debian's packages:
``slurmctld slurmd slurm-client``, deploy/local/setup.sh); `missing` says
what is absent, for a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from sbtest import wait_for
from springback.cli.local import free_port

BINARIES = ("slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol", "squeue", "scancel")
"""What the cluster and its tests run (Debian: slurmctld, slurmd, slurm-client)."""


def missing() -> str | None:
    """Why a Slurm cluster cannot start here (a skip's message), or None."""
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} missing): "
                "bash deploy/local/setup.sh installs it (apt: slurmctld slurmd slurm-client)")
    if os.geteuid() != 0:
        return "the Slurm tests run slurmd, which needs root"
    return None


PREEMPT_GRACE_S = 10
"""``GraceTime`` of partition ``test``: a preempted job's tasks get SIGTERM,
then SIGKILL no sooner than this (Slurm 22.05 waits longer than it says)."""

CRED_EXPIRE_S = 10
"""``AuthInfo=cred_expire`` (slurm.conf(5): the job step credential's
lifetime, which "also controls how long a requeued job must wait before
starting again"; 120 s by default). A requeued job here is held for about
this long (measured: BeginTime = the requeue + 11 s) instead of two minutes."""


class SlurmCluster:
    """`num_nodes` nodes ``node1`` … in partition ``test`` (the default) and,
    over the same nodes, partition ``high``, whose jobs preempt those of
    ``test`` (``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``,
    ``GraceTime`` `PREEMPT_GRACE_S`): what a preemptible spot partition under
    a higher-priority one is. Nothing is preempted until a job is submitted to
    ``high``. A requeued job runs again `CRED_EXPIRE_S` after its requeue."""

    def __init__(self, directory: Path, num_nodes: int = 3, *, slurmd_timeout_s: int = 10,
                 kill_wait_s: int = 5) -> None:
        self.directory = directory
        self.nodes = [f"node{i}" for i in range(1, num_nodes + 1)]
        self.conf = directory / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._slurmd_timeout_s, self._kill_wait_s = slurmd_timeout_s, kill_wait_s
        self._processes: dict[str, subprocess.Popen] = {}

    def _write_conf(self) -> None:
        d = self.directory
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=sbtest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            f"AuthInfo=cred_expire={CRED_EXPIRE_S}",  # a requeued job waits this long, not 120 s
            "CredType=cred/none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",
            # A requeued job whose hold ended starts within 2 s, not at the next
            # minute's scheduling pass (nothing else wakes the scheduler then).
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/linear",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "ReturnToService=2",  # a node that was DOWN comes back when it registers
            f"SlurmdTimeout={self._slurmd_timeout_s}",
            f"KillWait={self._kill_wait_s}",
            "InactiveLimit=0",
            "MinJobAge=10",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        # CPUs=1: never more than the host has, or slurmd's node is INVAL.
        lines += [f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
                  "CPUs=1 State=UNKNOWN" for n in self.nodes]
        nodes = ",".join(self.nodes)
        lines.append(f"PartitionName=test Nodes={nodes} Default=YES MaxTime=INFINITE State=UP "
                     f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={PREEMPT_GRACE_S}")
        lines.append(f"PartitionName=high Nodes={nodes} MaxTime=INFINITE State=UP "
                     "PriorityTier=2 PreemptMode=OFF")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.directory / f"{name}.out", "ab")  # noqa: SIM115 (the child holds it)
        try:
            self._processes[name] = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        finally:
            log.close()

    def start(self, timeout_s: float = 30.0) -> None:
        """Writes slurm.conf, starts slurmctld and one slurmd per node, and
        waits until `sinfo` shows every node idle. Raises AssertionError
        naming the daemons' logs after `timeout_s`."""
        self._write_conf()
        for sub in self.nodes:
            (self.directory / "spool" / sub).mkdir(parents=True, exist_ok=True)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        try:
            wait_for(lambda: self.idle_nodes() == set(self.nodes), timeout_s,
                     f"{len(self.nodes)} idle Slurm nodes (logs in {self.directory})")
        except AssertionError:
            self._check_alive()
            raise

    def _check_alive(self) -> None:
        for name, p in self._processes.items():
            if p.poll() is not None:
                out = (self.directory / f"{name}.out").read_text(errors="replace")[-2000:]
                raise AssertionError(f"{name} exited with {p.returncode}: {out}")

    def run(self, *argv: str, timeout_s: float = 10.0) -> str:
        """A Slurm command against this cluster; its stdout. Raises
        CalledProcessError (with stderr) on failure, TimeoutExpired after `timeout_s`."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=True,
                              timeout=timeout_s).stdout

    def node_states(self) -> dict[str, str]:
        """Each node's state as `sinfo` prints it (``idle``, ``alloc``, ``down*`` …)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def idle_nodes(self) -> set[str]:
        return {n for n, state in self.node_states().items() if state == "idle"}

    def set_down(self, node: str, reason: str = "test") -> None:
        """What an admin does to a failing node: DOWN at once (its tasks get SIGKILL)."""
        self.run("scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}")

    def jobs(self) -> list[str]:
        """The ids of the jobs Slurm still knows as pending or running."""
        return self.run("squeue", "-h", "-o", "%i").split()

    def stop(self) -> None:
        """Cancels every job (so no task outlives the cluster), then stops the
        daemons by PID: SIGTERM, SIGKILL after 10 s. Safe to call twice."""
        if self._processes.get("slurmctld") and self._processes["slurmctld"].poll() is None:
            try:
                for job in self.jobs():
                    self.run("scancel", job)
                wait_for(lambda: not self.jobs(), 20, "Slurm's jobs to end")
            except (AssertionError, subprocess.SubprocessError) as e:
                print(f"slurmcluster: jobs not cancelled cleanly: {e}")
        for name, p in reversed(list(self._processes.items())):  # slurmds first
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self._processes.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
