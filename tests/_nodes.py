"""Start a job as several "nodes" on this machine: one launcher per node, rendezvous on localhost.

:func:`start_nodes` starts the launchers of one door (``lightning-plugins finetune`` with ``hardware.nodes``, each
launcher told its ``NODE_RANK``; or ``accelerate launch`` with ``--num_machines`` and each ``--machine_rank``) and
returns a :class:`Nodes`: the launchers' ``Popen`` objects (each in a session and process group of its own, so a
test can signal one node's launcher, :meth:`Nodes.signal`, or its whole group, :meth:`Nodes.signal_group`), a bounded
:meth:`Nodes.wait`, each node's output, and cleanup that leaves no process behind. Every process of the job carries
a marker in its environment, so cleanup (and :meth:`Nodes.alive`) finds the ranks too, even those whose launcher is
gone (an orphan is re-parented, but keeps its environment).
"""

from __future__ import annotations

import os
from signal import SIGKILL, SIGTERM
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from lightning_plugins.testing.world import check_exit, free_port, script_env

ROOT = Path(__file__).parents[1]
#: The environment variable that marks every process of one simulated job.
MARKER = "LIGHTNING_PLUGINS_TEST_NODES"
#: A CPU launch config for the Accelerate door; ``--num_machines`` / ``--num_processes`` override its world.
ACCELERATE_CONFIG = ROOT / "accelerate_configs" / "cpu_2proc.yaml"


class Nodes:
    """The launchers of one simulated multi-node job (use as a context manager: leaving it ends every process).

    Attributes:
        launchers: One ``Popen`` per node, node rank order.
        logs: The folder holding each node's ``node<N>.out`` / ``node<N>.err``.
    """

    def __init__(
        self, launchers: list[subprocess.Popen], logs: Path, token: str, cleanup: tempfile.TemporaryDirectory
    ) -> None:
        self.launchers, self.logs, self._token, self._cleanup = launchers, logs, token, cleanup

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._cleanup.cleanup()

    def signal(self, node: int, sig: int = SIGKILL) -> None:
        """Send ``sig`` to node ``node``'s launcher process only."""
        self.launchers[node].send_signal(sig)

    def signal_group(self, node: int, sig: int = SIGTERM) -> None:
        """Send ``sig`` to the process group of node ``node``'s launcher (what ``scancel`` or ``kill -- -PGID`` do)."""
        os.killpg(self.launchers[node].pid, sig)

    def wait(self, timeout: float) -> dict[str, int]:
        """Wait up to ``timeout`` s (in all) for every launcher; return their exit statuses by node.

        Raises:
            AssertionError: a launcher still runs at the deadline (every process is stopped first), with the output.
        """
        deadline = time.monotonic() + timeout
        for node, proc in enumerate(self.launchers):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                said = f"node {node}'s launcher still ran after {timeout:g} s\n{self.output()[-8000:]}"
                raise AssertionError(said) from None
        return {f"node {n}": p.returncode for n, p in enumerate(self.launchers)}

    def check(self, timeout: float, expected: int | None = 0) -> dict[str, int]:
        """:meth:`wait`, then :func:`lightning_plugins.testing.world.check_exit` on every launcher (status ``expected``, no native crash)."""
        codes = self.wait(timeout)
        check_exit(codes, self.output(), expected)
        return codes

    def out(self, node: int) -> str:
        """What node ``node``'s launcher (and the ranks it started) printed on standard output."""
        return (self.logs / f"node{node}.out").read_text(errors="replace")

    def err(self, node: int) -> str:
        """What node ``node``'s launcher (and the ranks it started) printed on standard error."""
        return (self.logs / f"node{node}.err").read_text(errors="replace")

    def output(self) -> str:
        """Every node's output, labelled."""
        return "".join(f"--- node {n}:\n{self.out(n)}{self.err(n)}" for n in range(len(self.launchers)))

    def alive(self) -> list[int]:
        """The pids of this job's processes still running (launchers, ranks, orphans)."""
        found = []
        needle = f"{MARKER}={self._token}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # ended meanwhile, or not ours
                continue
            if needle in environ.split(b"\0") and state != "Z":
                found.append(int(entry.name))
        return found

    def wait_gone(self, timeout: float) -> float:
        """Seconds until every process of the job has ended (at most ``timeout``; reaps the launchers).

        Raises:
            AssertionError: naming the processes still running at the deadline (they are stopped first).
        """
        start = time.monotonic()
        while True:
            left = self.alive()
            if not left:
                for proc in self.launchers:  # ended: a zombie waiting to be reaped at most
                    proc.wait()
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                described = {pid: _cmdline(pid) for pid in left}
                self.stop()
                raise AssertionError(f"still running {timeout:g} s later: {described}\n{self.output()[-8000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGKILL every process of the job still running, then reap the launchers."""
        for _ in range(3):  # a launcher may start a rank while we kill: look again
            pids = self.alive()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for proc in self.launchers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def node_commands(
    door: str, recipe: Path, args: Sequence[str], nodes: int, devices: int, port: int
) -> list[tuple[list[str], dict[str, str]]]:
    """Each node's ``(command, environment additions)`` for ``door`` (``finetune`` or ``accelerate``).

    Args:
        door: ``finetune`` (``python -m lightning_plugins finetune``) or ``accelerate`` (``accelerate launch``).
        recipe: The recipe file.
        args: Overrides after the recipe (``--train.output_dir=...``); the world's size is set here.
        nodes: How many nodes.
        devices: Processes per node.
        port: The rendezvous port on 127.0.0.1.
    """
    commands = []
    for node in range(nodes):
        if door == "finetune":
            world = [f"--hardware.nodes={nodes}", f"--hardware.devices={devices}"]
            command = [sys.executable, "-m", "lightning_plugins", "finetune", str(recipe), *world, *args]
            env = {"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        elif door == "accelerate":
            command = [
                str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(ACCELERATE_CONFIG),
                "--num_machines", str(nodes), "--num_processes", str(nodes * devices), "--machine_rank", str(node),
                "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                "-m", "lightning_plugins.accelerate", str(recipe), *args,
            ]  # fmt: skip
            env = {}
        else:
            raise ValueError(f"unknown door {door!r} (finetune, accelerate)")
        commands.append((command, env))
    return commands


def start_nodes(door: str, recipe: Path, *args: str, nodes: int = 2, devices: int = 2, **env: str) -> Nodes:
    """Start ``nodes`` launchers of ``door`` on this machine, node ranks ``0 .. nodes-1``, rendezvous on localhost.

    Args:
        door: ``finetune`` or ``accelerate`` (see :func:`node_commands`).
        recipe: The recipe file.
        args: Recipe overrides.
        nodes: How many nodes.
        devices: Processes per node.
        env: Extra environment for every node.

    Returns:
        The running job; use it as a context manager so that no process outlives the test.
    """
    token = uuid.uuid4().hex
    holder = tempfile.TemporaryDirectory(prefix="nodes_")
    logs = Path(holder.name)
    launchers = []
    port = free_port()
    try:
        for node, (command, extra) in enumerate(node_commands(door, recipe, args, nodes, devices, port)):
            with open(logs / f"node{node}.out", "w") as out, open(logs / f"node{node}.err", "w") as err:
                launchers.append(
                    subprocess.Popen(
                        command, cwd=ROOT, stdout=out, stderr=err, start_new_session=True,
                        env=script_env(**{**env, **extra, MARKER: token}),
                    )
                )  # fmt: skip
    except BaseException:
        Nodes(launchers, logs, token, holder).__exit__()
        raise
    return Nodes(launchers, logs, token, holder)
