"""A launcher's place in a Slurm job step: `srun --ntasks-per-node=1 conveyor run -n G train.py` needs no flags.

    node = slurm_node(os.environ)       # None outside an srun step
    node.nnodes, node.node_rank, node.rdzv    # what --nnodes, --node-rank and --rdzv would have said

srun starts one launcher per node and tells each one, in its own environment, which step it belongs to:
the step's nodes in order (``SLURM_STEP_NODELIST``, ranges such as ``gpu[01-04,07]``), their count, this
node's index among them (``SLURM_NODEID``), the node slurmd runs on (``SLURMD_NODENAME``) and the job id.
The rendezvous runs on the step's first node, at ``MASTER_PORT`` or a port derived from the job id
(:func:`conveyor.cluster.slurm_port`), so every launcher computes the same endpoint without talking.

The traps users of torchrun under Slurm meet are refused, naming the node: a first node whose name
does not resolve, or resolves to a loopback address (Debian's ``127.0.1.1 <hostname>`` line), never
becomes "localhost" - each node would form its own world; a ``--node-rank`` expanded once by the
batch shell (every node claims rank 0) disagrees with ``SLURM_NODEID``; a ``SLURM_NODEID`` that names
another node than ``SLURMD_NODENAME``; several launchers per node. A heterogeneous job's step (training nodes,
then data nodes: ``conveyor slurm --data-nodes``) numbers its nodes component by component. docs/clusters.md.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from conveyor.cluster import ClusterConfigError, expand_hostlist, join_address, slurm_port
from conveyor.cluster.spec import MAX_INDEX, parse_decimal, show

__all__ = ["SlurmNode", "allocation_note", "slurm_node"]

Resolver = Callable[[str, int], str]

_SRUN = "srun --ntasks-per-node=1 conveyor run -n G ..."


@dataclass(frozen=True)
class SlurmNode:
    """This launcher's node in the step: what ``--nnodes``, ``--node-rank`` and ``--rdzv`` would say."""

    job_id: str
    nodes: tuple[str, ...]
    node_rank: int
    rdzv: str  # "address:port" of the step's first node, resolved here

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def name(self) -> str:
        return self.nodes[self.node_rank]

    def describe(self) -> str:
        return (f"Slurm job {self.job_id}: node {self.node_rank} of {self.nnodes} ({self.name}); the rendezvous at "
                f"{self.rdzv} (first node: {self.nodes[0]})")


def resolve(name: str, port: int) -> str:
    """``name``'s first address for a TCP connection (what the other launchers will connect to)."""
    return socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)[0][4][0]


def in_step(environ: Mapping[str, str]) -> bool:
    """Whether this process was started by srun as a task of a job step (not the batch script itself, which has
    no step id, or a special one that is not a number)."""
    step = environ.get("SLURM_STEP_ID", "").strip()
    return step.isascii() and step.isdigit() and bool(environ.get("SLURM_JOB_ID")) and "SLURM_NODEID" in environ


def allocation_note(environ: Mapping[str, str]) -> str | None:
    """A warning for `conveyor run` started in a multi-node allocation but outside srun (only this node works)."""
    nodes = parse_decimal(environ.get("SLURM_JOB_NUM_NODES", "").strip(), MAX_INDEX)
    if in_step(environ) or not nodes or nodes < 2:
        return None
    return (f"this Slurm allocation has {nodes} nodes, but conveyor run was not started by srun: only this node "
            f"runs tasks; start one launcher per node with `{_SRUN}`")


def slurm_node(environ: Mapping[str, str], *, nnodes: int | None = None, node_rank: int | None = None,
               rdzv: str | None = None, resolver: Resolver = resolve) -> SlurmNode | None:
    """This launcher's node in its srun step, checked; ``None`` outside a step, in a step of one node, or with
    ``nnodes=1`` (one job per node, on purpose).

    ``nnodes``/``node_rank``/``rdzv`` are the flags the user gave (``None``: not given): given ones must
    agree with Slurm, and a given ``rdzv`` replaces the derived endpoint. Raises :class:`ClusterConfigError`.
    """
    if not in_step(environ) or nnodes == 1:
        return None
    nodes = _step_nodes(environ)
    if len(nodes) < 2:
        return None
    rank = _node_id(environ, nodes)
    _check_one_launcher_per_node(environ, nodes)
    if nnodes is not None and nnodes != len(nodes):
        raise ClusterConfigError(f"--nnodes {nnodes}, but this Slurm step runs on {len(nodes)} nodes "
                                 f"({_nodelist(environ)}); drop --nnodes: conveyor run reads it from Slurm")
    if node_rank is not None and node_rank != rank:
        raise ClusterConfigError(
            f"--node-rank {node_rank}, but Slurm says this node ({nodes[rank]}) is node {rank} (SLURM_NODEID={rank}); "
            f"the rank was probably expanded once by the batch script's shell before srun started the step, so every "
            f"node got the same one: drop --node-rank (conveyor run reads SLURM_NODEID itself), or write "
            f"'$SLURM_NODEID' inside single quotes")
    job_id = environ["SLURM_JOB_ID"].strip()
    endpoint = rdzv if rdzv is not None else _endpoint(environ, nodes, rank, job_id, resolver)
    return SlurmNode(job_id=job_id, nodes=tuple(nodes), node_rank=rank, rdzv=endpoint)


def _nodelist(environ: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if environ.get(name):
            return f"{name}={show(environ[name])}"
    return "no node list"


def _step_nodes(environ: Mapping[str, str]) -> list[str]:
    """The step's nodes in node-id order; the step's own list first (a step may use part of the allocation)."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if environ.get(name):
            nodes = expand_hostlist(environ[name], name=name)
            break
    else:
        raise ClusterConfigError("SLURM_STEP_NODELIST, SLURM_NODELIST and SLURM_JOB_NODELIST are all unset in a Slurm "
                                 "step; srun sets them: start the launchers with srun inside the allocation")
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if environ.get(name):
            count = parse_decimal(environ[name].strip(), MAX_INDEX)
            if count != len(nodes):
                raise ClusterConfigError(f"{name}={show(environ[name])} but {_nodelist(environ)} lists {len(nodes)} "
                                         f"nodes; the two come from different steps (was one of them exported?)")
            break
    if len(set(nodes)) != len(nodes):
        raise ClusterConfigError(f"{_nodelist(environ)} names a node twice; Slurm lists each node of a step once")
    return _het_order(environ, nodes)


def _het_order(environ: Mapping[str, str], nodes: list[str]) -> list[str]:
    """The step's nodes in SLURM_NODEID order. A step over several components of a heterogeneous job (`srun ... :
    ...`) lists its nodes sorted by name, yet numbers them component by component (the training nodes, then the
    data nodes): its order is then its components' node lists one after another (measured on Slurm 22.05)."""
    size = parse_decimal(environ.get("SLURM_HET_SIZE", "").strip(), MAX_INDEX)
    if not size or size < 2:
        return nodes
    step, ordered = set(nodes), []
    for group in range(size):
        name = f"SLURM_JOB_NODELIST_HET_GROUP_{group}"
        if not environ.get(name):
            return nodes
        component = expand_hostlist(environ[name], name=name)
        if step.issuperset(component):  # a component this step runs on (a step may span some of them)
            ordered += component
    return ordered if sorted(ordered) == sorted(nodes) else nodes


def _node_id(environ: Mapping[str, str], nodes: list[str]) -> int:
    text = environ["SLURM_NODEID"].strip()
    rank = parse_decimal(text, MAX_INDEX)
    if rank is None or rank >= len(nodes):
        raise ClusterConfigError(f"SLURM_NODEID={show(text)} is not a node index 0..{len(nodes) - 1} of "
                                 f"{_nodelist(environ)}; srun sets it per node: do not set it yourself")
    here = environ.get("SLURMD_NODENAME", "").strip()
    if here and here != nodes[rank]:
        raise ClusterConfigError(f"SLURM_NODEID={rank} names node {nodes[rank]} of {_nodelist(environ)}, but this is "
                                 f"{here} (SLURMD_NODENAME); SLURM_NODEID was set or expanded on another node: let "
                                 f"srun set it, one launcher per node (`{_SRUN}`)")
    return rank


def _check_one_launcher_per_node(environ: Mapping[str, str], nodes: list[str]) -> None:
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if environ.get(name):
            tasks = parse_decimal(environ[name].strip(), MAX_INDEX)
            if tasks is not None and tasks != len(nodes):
                raise ClusterConfigError(f"srun started {tasks} tasks on {len(nodes)} nodes ({name}), but conveyor run "
                                         f"is its node's launcher and starts the node's tasks itself (-n, --ps): start "
                                         f"exactly one per node, `{_SRUN}`")
            return


def _endpoint(environ: Mapping[str, str], nodes: list[str], rank: int, job_id: str, resolver: Resolver) -> str:
    port_text = environ.get("MASTER_PORT", "").strip()
    if port_text:
        port = parse_decimal(port_text, 65535)
        if not port:
            raise ClusterConfigError(f"MASTER_PORT={show(port_text)} is not a port number 1-65535; unset it (the "
                                     f"rendezvous port is then derived from SLURM_JOB_ID) or give a free port")
    else:
        port = slurm_port(job_id)
    first, here = nodes[0], nodes[rank]
    try:
        address = resolver(first, port)
    except (OSError, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise ClusterConfigError(f"Slurm node {first}, the first of {_nodelist(environ)}, where the rendezvous runs, "
                                 f"does not resolve on {here} ({reason}); every node must resolve every node's name "
                                 f"(DNS or /etc/hosts), or give --rdzv ADDRESS:PORT with {first}'s address") from None
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        raise ClusterConfigError(f"Slurm node {first}, the first of {_nodelist(environ)}, resolves to {address} on "
                                 f"{here}, a loopback address the other nodes cannot reach: each node would form a job "
                                 f"of its own; map {first} to its network address in DNS or /etc/hosts (Debian adds "
                                 f"'127.0.1.1 <hostname>': remove it), or give --rdzv ADDRESS:PORT")
    return join_address(address, port)
