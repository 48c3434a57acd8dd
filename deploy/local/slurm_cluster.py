"""A real Slurm on loopback, for the Slurm tests (tests/slurmcluster.py) and
``deploy/local/demo.sh --slurm``: one ``slurmctld`` and several
``slurmd -N nodeN`` on this host, each on a port of its own.

Everything private lives under one directory (slurm.conf, state, spools, pid
and log files); no munge (``AuthType=auth/none``, ``CredType=cred/none``),
no cgroups (``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``).
The daemons run in the foreground (``-D``) as this process's children and are
stopped by PID. Every node has the same ``hostname``: a task tells its node by
``SLURMD_NODENAME``. `env` is what a Slurm command (srun, sinfo, scontrol)
needs to talk to this cluster (``SLURM_CONF``).

Where the cgroup v1 ``freezer`` hierarchy is mounted (`FREEZER_ROOT`), every
daemon starts in a freezer group of its own under one group per cluster
directory (``springback-slurm-HASH/slurmctld``, ``…/node1`` …), and what it
starts (slurmstepd, the tasks, their children) inherits it (Slurm itself
uses no cgroups here). So a node can crash as a whole (`crash`: the group
frozen, every process in it SIGKILLed, thawed), come back (`restart`), and
`stop` leaves nothing behind: whatever is still in a group, even an
orphaned task, is killed; a later cluster on the same directory first kills
what an interrupted one left (`kill_leftovers`).

Needs root (slurmd runs tasks as their user, and Debian's packages:
``slurmctld slurmd slurm-client``, deploy/local/setup.sh); `missing` says
what is absent, for a skip.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from springback.cli.local import free_port
from springback.client.polling import wait_until

T = TypeVar("T")

FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")
"""The cgroup v1 freezer hierarchy: a group per node, to crash it as a whole."""


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    """Polls `predicate` until truthy (an exception counts as not yet);
    AssertionError naming `what` after `timeout_s`."""
    def attempt() -> T | None:
        try:
            return predicate()
        except Exception:  # noqa: BLE001 (not yet)
            return None
    value = wait_until(attempt, timeout_s=timeout_s)
    if not value:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
    return value

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
        self.cgroup: Path | None = None
        """This cluster's freezer group (None where the hierarchy is not mounted)."""
        if FREEZER_ROOT.is_dir() and os.access(FREEZER_ROOT, os.W_OK):
            key = hashlib.sha1(str(directory.resolve()).encode()).hexdigest()[:12]
            self.cgroup = FREEZER_ROOT / f"springback-slurm-{key}"

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
        """Starts daemon `name`; with cgroups, in its own freezer group (the
        shell moves itself into it, then execs the daemon, so nothing the
        daemon starts is ever outside)."""
        if self.cgroup is not None:
            group = self.cgroup / name
            group.mkdir(parents=True, exist_ok=True)
            argv = ["sh", "-c", f'echo $$ > {shlex.quote(str(group / "cgroup.procs"))} '
                    f'&& exec {shlex.join(argv)}']
        log = open(self.directory / f"{name}.out", "ab")  # noqa: SIM115 (the child holds it)
        try:
            self._processes[name] = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        finally:
            log.close()

    def group_pids(self, name: str) -> list[int]:
        """The processes in daemon `name`'s freezer group: the daemon and all
        it started (for a node: slurmd, slurmstepd, the tasks and theirs)."""
        if self.cgroup is None:
            raise RuntimeError(f"no freezer cgroup hierarchy at {FREEZER_ROOT}")
        try:
            return [int(pid) for pid in (self.cgroup / name / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def _kill_group(self, group: Path) -> list[int]:
        """Freezes `group` (no process in it runs, forks or sees another
        die), SIGKILLs every process in it, thaws it, and waits until it is
        empty. The pids killed."""
        state, procs = group / "freezer.state", group / "cgroup.procs"
        state.write_text("FROZEN")
        wait_for(lambda: state.read_text().strip() == "FROZEN", 10, f"{group} to freeze")
        pids = [int(pid) for pid in procs.read_text().split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        state.write_text("THAWED")  # a frozen process dies of its SIGKILL once thawed
        wait_for(lambda: not procs.read_text().split(), 10, f"{group} to empty")
        return pids

    def crash(self, node: str) -> list[int]:
        """Node `node` crashes as a whole: slurmd, slurmstepd, the tasks and
        everything they started, SIGKILLed at one instant (`_kill_group`).
        slurmctld learns of it only by its pings (the node goes DOWN about
        ``SlurmdTimeout`` + 9 s later). The pids killed."""
        if self.cgroup is None:
            raise RuntimeError(f"no freezer cgroup hierarchy at {FREEZER_ROOT}")
        pids = self._kill_group(self.cgroup / node)
        self._processes[node].wait(timeout=10)
        return pids

    def restart(self, node: str) -> None:
        """Starts node `node`'s slurmd again (after `crash`), as a rebooted
        node does; it registers and, with ``ReturnToService=2``, is idle again."""
        assert self._processes[node].poll() is not None, f"{node}'s slurmd still runs"
        self._spawn(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])

    def kill_leftovers(self) -> list[int]:
        """Kills every process a cluster on this directory left in its groups
        (an interrupted run: its daemons, agents and ranks) and removes the
        groups. The pids killed."""
        if self.cgroup is None or not self.cgroup.is_dir():
            return []
        killed = []
        for group in [g for g in self.cgroup.iterdir() if g.is_dir()] + [self.cgroup]:
            killed += self._kill_group(group)
        for group in [g for g in self.cgroup.iterdir() if g.is_dir()] + [self.cgroup]:
            group.rmdir()
        return killed

    def start(self, timeout_s: float = 30.0) -> None:
        """Writes slurm.conf, starts slurmctld and one slurmd per node, and
        waits until `sinfo` shows every node idle. Raises AssertionError
        naming the daemons' logs after `timeout_s`."""
        self.kill_leftovers()
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
        daemons by PID: SIGTERM, SIGKILL after 10 s; then kills whatever is
        left in their cgroups (`kill_leftovers`). Safe to call twice."""
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
        self.kill_leftovers()
