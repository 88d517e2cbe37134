"""`conveyor k8s`: a job's Kubernetes manifests; `conveyor k8s-task`: the command each of its pods runs.

    conveyor k8s --name digits --image registry.example.com/digits:1 -n 2 --ps 1 --strategy ps-sync \\
        --data-claim digits-data --output-claim digits-output -f digits.yaml train.py --epochs 20
    kubectl apply -f digits.yaml

The manifests are built in :mod:`conveyor.launch.k8s` (pure); a pod's task, from the index Kubernetes
gives it, in :mod:`conveyor.launch.pod`. `k8s-task` replaces itself with the script (exec), so the
script is the container's process: it gets the kubelet's signals and its exit status is the pod's.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys

from conveyor.cli import Command, CommandError
from conveyor.cluster.settings import add_arguments as add_settings
from conveyor.cluster.settings import given as given_settings
from conveyor.errors import RendezvousError
from conveyor.fileio import atomic_write
from conveyor.launch.k8s import KINDS, K8sOptions, manifests, roles, to_yaml
from conveyor.launch.pod import pod_launch, timeout_of, wait_for_hosts

EXAMPLES = """\
examples:
  conveyor k8s --name digits --image registry.example.com/digits:1 -n 2 --ps 1 --strategy ps-sync \\
      --data-claim digits-data --output-claim digits-output -f digits.yaml train.py --epochs 20
  kubectl apply -f digits.yaml        # needs the JobSet controller (https://jobset.sigs.k8s.io); or --kind jobs
  conveyor k8s --name lm --image registry.example.com/lm:1 -n 4 --strategy pipeline --stages 2 \\
      --output-claim lm-output -f lm.yaml train.py      # 2 pipeline replicas of 2 stages

Every pod runs `conveyor k8s-task --role R --cluster JSON SCRIPT ARGS` in IMAGE (conveyor installed, SCRIPT
at that path inside it): the pod's index (JOB_COMPLETION_INDEX) picks its task, and the script gets what
`conveyor run` gives a task (TF_CONFIG, RANK, WORLD_SIZE, MASTER_ADDR, ..., CONVEYOR_*). Task i of a role
is the pod NAME-ROLE-0-i.NAME (--kind jobs: NAME-ROLE-i.NAME). The data claim is mounted read-only at
--data-dir in every pod, the output claim (ReadWriteMany: checkpoints and ps shards meet there) at
--output-dir. The job secret goes into a new Secret NAME-secret (the file then holds it: it is written
with mode 600), or comes from --secret-name, an existing Secret with the key `secret`. A NetworkPolicy
admits only the job's pods. With JobSet, a failed pod restarts the whole job (every pod) up to
--max-restarts times, and the script resumes from the last checkpoint; --kind jobs has no restarts.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    job = parser.add_argument_group("the job")
    job.add_argument("--name", required=True, help="the job's name: its objects', pods' and Service's prefix")
    job.add_argument("--image", required=True, help="the container image every pod runs (with conveyor)")
    job.add_argument("-n", "--workers", type=int, default=1, metavar="N", help="training pods (default 1)")
    job.add_argument("--ps", type=int, default=0, metavar="M", help="parameter-server pods (default 0)")
    job.add_argument("--gpus", type=int, default=0, metavar="G",
                     help="1: each training pod asks for a GPU (nvidia.com/gpu) and trains on it (default 0)")
    job.add_argument("--data-workers", type=int, default=0, metavar="K",
                     help="data-service worker pods (no GPU) and a dispatcher pod; the trainers find it in "
                     "$CONVEYOR_DATA_SERVICE (default 0; docs/data-service.md)")
    job.add_argument("--data-pipeline", default=None, metavar="MODULE:FUNCTION",
                     help="the function (importable in the image) returning the Dataset the data workers run")
    pipe = parser.add_argument_group("pipeline parallelism (--strategy pipeline)")
    add_settings(dict(job=job, pipeline=pipe), "k8s")  # --strategy, --timeout, --max-restarts, --stages, ...
    cluster = parser.add_argument_group("Kubernetes")
    cluster.add_argument("--kind", choices=KINDS, default="jobset",
                         help="jobset (default: whole-job restarts) or jobs (plain Jobs + a Service, no restarts)")
    cluster.add_argument("--namespace", default=None, help="the objects' namespace (default: kubectl's)")
    cluster.add_argument("--data-claim", default=None, metavar="PVC",
                         help="a PersistentVolumeClaim holding the input, mounted read-only at --data-dir")
    cluster.add_argument("--data-dir", default="/data", metavar="PATH", help="the data folder in the pods")
    cluster.add_argument("--output-claim", required=True, metavar="PVC",
                         help="a ReadWriteMany PersistentVolumeClaim for checkpoints, logs, metrics")
    cluster.add_argument("--output-dir", default="/output", metavar="PATH", help="the output folder in the pods")
    cluster.add_argument("--output-size", default=None, metavar="SIZE",
                         help="also write the output claim itself, of this size (e.g. 50Gi)")
    cluster.add_argument("--storage-class", default=None, metavar="NAME", help="the new output claim's class")
    cluster.add_argument("--secret-name", default=None, metavar="NAME",
                         help="use this existing Secret (key `secret`: 64 hex digits) instead of writing one")
    cluster.add_argument("--no-network-policy", dest="network_policy", action="store_false",
                         help="write no NetworkPolicy (by default one admits traffic to the pods from the job's pods "
                         "only)")
    cluster.add_argument("--port", type=int, default=2222, help="each task's port in TF_CONFIG (default 2222)")
    cluster.add_argument("--master-port", type=int, default=29500,
                         help="rank 0's port for torch's store, MASTER_PORT (default 29500)")
    cluster.add_argument("-f", "--file", default=None, metavar="FILE", help="write the YAML here (default: stdout)")
    parser.add_argument("script", metavar="SCRIPT", help="the training script, its path inside the image")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


def run(args: argparse.Namespace) -> int:
    options = K8sOptions(
        name=args.name, image=args.image, script=args.script, script_args=tuple(args.script_args),
        workers=args.workers, ps=args.ps, gpus=args.gpus, data_claim=args.data_claim, data_dir=args.data_dir,
        output_claim=args.output_claim, output_dir=args.output_dir, output_size=args.output_size,
        storage_class=args.storage_class, secret_name=args.secret_name, namespace=args.namespace, kind=args.kind,
        port=args.port, master_port=args.master_port, network_policy=args.network_policy,
        data_workers=args.data_workers, data_pipeline=args.data_pipeline, **given_settings(args, "k8s"),
    )
    secret = None if options.secret_name else secrets.token_hex(32)
    try:
        text = to_yaml(manifests(options, secret), _header(options, args.file))
    except ImportError as e:
        raise CommandError(f"writing YAML needs PyYAML ({e}); pip install 'conveyor[k8s]' brings it") from None
    if args.file is None:
        sys.stdout.write(text)
    else:  # it may hold the job secret: readable by its owner only
        atomic_write(args.file, text.encode(), mode=0o600 if secret else None)
        print(f"conveyor k8s: wrote {args.file}; start the job with: kubectl apply -f {args.file}", file=sys.stderr)
    return 0


def _header(options: K8sOptions, path: str | None) -> str:
    shape = ", ".join(f"{count} {role}{'s' if role == 'worker' and count > 1 else ''}"
                      for role, count in roles(options))
    kind = "a JobSet (needs the JobSet controller)" if options.kind == "jobset" else "Indexed Jobs and a Service"
    lines = [f"conveyor job {options.name}: {shape}, strategy {options.strategy}, as {kind}.",
             f"Start: kubectl apply -f {path or 'FILE'}    Stop: kubectl delete -f {path or 'FILE'}",
             f"Needs the claims {', '.join(c for c in (options.data_claim, options.output_claim) if c)}"
             f"{' (the output claim is written here)' if options.output_size else ''}."]
    if options.secret_name is None:
        lines.append(f"Holds the job secret (Secret {options.secret}): keep this file private.")
    return "\n".join(lines)


COMMAND = Command("k8s", "write the Kubernetes manifests (JobSet or Jobs) of a job", add_arguments, run)


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, choices=("chief", "worker", "ps"), help="this pod's job")
    parser.add_argument("--cluster", required=True, metavar="JSON", help="TF_CONFIG's cluster: every pod's address")
    parser.add_argument("--master-port", type=int, default=29500, help="rank 0's port for torch's store")
    parser.add_argument("--tf-flags", action="store_true", help="give the script TensorFlow 1's cluster flags")
    parser.add_argument("--python", default=sys.executable, metavar="PATH", help="the interpreter for SCRIPT")
    parser.add_argument("script", metavar="SCRIPT", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


def run_task(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    launch = pod_launch(environ, role=args.role, cluster=args.cluster, master_port=args.master_port,
                        script=args.script, script_args=tuple(args.script_args), python=args.python,
                        use_tf_flags=args.tf_flags)
    print(f"[conveyor] pod {socket.gethostname()} is {launch.task} of {launch.spec.as_dict()}", file=sys.stderr,
          flush=True)
    try:
        wait_for_hosts(launch.hosts, timeout_of(environ),
                       note=lambda line: print(f"[conveyor] {line}", file=sys.stderr, flush=True))
    except RendezvousError as e:
        raise CommandError(str(e), exit_code=1) from None
    os.execvpe(launch.argv[0], list(launch.argv), dict(launch.env))
    return 1  # not reached: exec replaced this process, or raised


TASK_COMMAND = Command("k8s-task", "inside a pod of `conveyor k8s`: become this pod's task of the job",
                       add_task_arguments, run_task)
