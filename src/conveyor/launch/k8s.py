"""Kubernetes manifests for a job, as plain dicts: what `conveyor k8s` writes (pure; no cluster needed).

    options = K8sOptions(name="digits", image="registry/digits:1", script="train.py", workers=2, ps=1,
                         strategy="ps-sync", data_claim="digits-data", output_claim="digits-output")
    print(to_yaml(manifests(options, secret=secrets.token_hex(32))))   # Secret, NetworkPolicy, JobSet

Each role (chief, worker, ps) is an Indexed Job (``completionMode: Indexed``): its pod of index i has the
hostname ``<job>-<i>`` and, with ``subdomain`` naming a headless Service, resolves as ``<job>-<i>.<service>``
in the namespace. So the whole cluster is known before any pod starts, and every pod runs the same
command, ``conveyor k8s-task --role R --cluster JSON SCRIPT ARGS``, which picks its task from the index
Kubernetes gives it (``JOB_COMPLETION_INDEX``; :mod:`conveyor.launch.pod`). Two kinds:

- ``jobset`` (default): a JobSet (jobset.x-k8s.io/v1alpha2), one replicated Job per role. Its controller
  makes the headless Service, and when a pod fails (its Job has ``backoffLimit: 0``) it recreates every
  Job: the whole-job restart of `conveyor run`, at most ``max_restarts`` times; a pod evicted or preempted
  (``DisruptionTarget``) restarts the set without counting. Pods: ``<name>-<role>-0-<i>.<name>``.
- ``jobs``: plain Indexed Jobs and a headless Service, for clusters without JobSet. Kubernetes restarts
  no set of Jobs together, and a pod replaced alone would meet a parameter server that outlived its
  workers, so a failed pod fails its Job; the others stop within the job's timeout, and applying the
  manifests again resumes from the last checkpoint. Pods: ``<name>-<role>-<i>.<name>``.

Every pod mounts the data claim read-only at the data folder and the output claim (ReadWriteMany: the
chief's checkpoints and the ps tasks' shards meet there) at the output folder, and gets the job secret
from a Secret. A NetworkPolicy admits only the job's own pods (``network_policy=False``: none).
``data_workers`` K adds a dispatcher pod and K data-worker pods (no GPU, restarted in place; docs/data-service.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from conveyor.cluster import ClusterSpec, join_address, validate
from conveyor.cluster.settings import JobSettings
from conveyor.cluster.spec import DATA_JOBS
from conveyor.cluster.variables import DATA_SERVICE_VAR, JOB_SECRET_VAR, RESTART_COUNT_VAR
from conveyor.launch.plan import DATA_WORKER_RESTARTS, job_strategy

__all__ = ["JOBSET_API", "KINDS", "SECRET_KEY", "K8sOptions", "cluster_of", "manifests", "pod_host", "roles",
           "to_yaml"]

KINDS = ("jobset", "jobs")
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
SECRET_KEY = "secret"  # the key of the job secret inside its Kubernetes Secret
#: The annotation JobSet puts on every pod: how many times the set was restarted (conveyor's restart count).
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # DNS-1035: Service and pod host names
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


@dataclass(frozen=True, kw_only=True)
class K8sOptions(JobSettings):
    """`conveyor k8s`'s options: the job's settings (:class:`JobSettings`: strategy, timeout, pipeline, ...)
    and the manifests' own, checked once (errors name the flag). ``workers`` counts training tasks, the
    chief among them with ``chief=True``, as under `conveyor run`; ``strategy`` is resolved (the default
    for the job's shape when ``None``)."""

    name: str
    image: str
    script: str
    output_claim: str
    script_args: tuple[str, ...] = ()
    workers: int = 1
    ps: int = 0
    gpus: int = 0
    data_claim: str | None = None
    data_dir: str = "/data"  # the folders inside the pods
    output_dir: str = "/output"
    output_size: str | None = None
    storage_class: str | None = None
    secret_name: str | None = None
    namespace: str | None = None
    kind: str = "jobset"
    port: int = 2222
    master_port: int = 29500
    network_policy: bool = True
    data_workers: int = 0  # data-service worker pods (no GPU), and then a dispatcher pod (docs/data-service.md)
    data_pipeline: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "script_args", tuple(self.script_args))
        if self.kind not in KINDS:
            raise ValueError(f"--kind {self.kind!r}: expected {' or '.join(KINDS)}")
        for flag, value, low in (("--workers", self.workers, 1), ("--ps", self.ps, 0), ("--gpus", self.gpus, 0),
                                 ("--data-workers", self.data_workers, 0)):
            validate.count(value, flag, low)
        if bool(self.data_workers) != bool(self.data_pipeline):
            raise ValueError("--data-workers K and --data-pipeline MODULE:FUNCTION go together: K data-worker pods "
                             "each build the pipeline that function (importable in the image) returns")
        if self.gpus > 1:
            raise ValueError(f"--gpus {self.gpus}: a pod runs one training process, which trains on one GPU "
                             f"(conveyor.init() takes the GPU of its local rank); for more GPUs run more pods "
                             f"(-n), which the scheduler places {self.gpus} or more to a machine")
        for flag, port in (("--port", self.port), ("--master-port", self.master_port)):
            if not 1 <= port <= 65535:
                raise ValueError(f"{flag} {port}: expected a port number 1-65535")
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"--image {self.image!r}: expected an image reference such as registry/train:1.0")
        if not self.script:
            raise ValueError("SCRIPT is missing: give the training script's path inside the image")
        for flag, path in (("--data-dir", self.data_dir), ("--output-dir", self.output_dir)):
            if not path.startswith("/") or path.rstrip("/") == "":
                raise ValueError(f"{flag} {path!r}: expected an absolute folder inside the pods, such as /data")
        if self.data_dir.rstrip("/") == self.output_dir.rstrip("/"):
            raise ValueError(f"--data-dir and --output-dir are both {self.data_dir}: two volumes need two folders")
        if self.output_size is not None and not _QUANTITY.fullmatch(self.output_size):
            raise ValueError(f"--output-size {self.output_size!r}: expected a Kubernetes quantity such as 50Gi")
        self._check_names()
        self.check_job(self.workers)
        object.__setattr__(self, "strategy", job_strategy(self.strategy, self.workers, self.ps))

    def _check_names(self) -> None:
        longest = max(len(pod_host(self, role, count - 1)) for role, count in roles(self))
        if not _DNS_LABEL.fullmatch(self.name) or longest > 63:
            raise ValueError(f"--name {self.name!r}: expected lower-case letters, digits and '-', starting with a "
                             f"letter, short enough that the longest pod name ({longest} characters now) has at "
                             f"most 63")
        names = (("--data-claim", self.data_claim), ("--output-claim", self.output_claim),
                 ("--secret-name", self.secret_name), ("--namespace", self.namespace),
                 ("--storage-class", self.storage_class))
        for flag, value in names:
            if value is not None and (not _DNS_SUBDOMAIN.fullmatch(value) or len(value) > 253):
                raise ValueError(f"{flag} {value!r}: expected a Kubernetes name (lower-case letters, digits, '-', "
                                 f"'.')")
        if self.namespace is not None and ("." in self.namespace or len(self.namespace) > 63):
            raise ValueError(f"--namespace {self.namespace!r}: a namespace is one DNS label (no '.', at most 63)")

    @property
    def secret(self) -> str:
        """The Secret holding the job secret: the one named, or ``<name>-secret``, written with the job."""
        return self.secret_name or f"{self.name}-secret"


def roles(options: K8sOptions) -> list[tuple[str, int]]:
    """``[(role, pods)]`` in rank order, roles without pods left out: chief, worker, ps, dispatcher, data_worker."""
    chief = 1 if options.chief else 0
    counts = [("chief", chief), ("worker", options.workers - chief), ("ps", options.ps),
              ("dispatcher", 1 if options.data_workers else 0), ("data_worker", options.data_workers)]
    return [(role, count) for role, count in counts if count]


def k8s_name(role: str) -> str:
    """A role as Kubernetes names may spell it (DNS labels have no '_'): ``data_worker`` → ``data-worker``."""
    return role.replace("_", "-")


def pod_host(options: K8sOptions, role: str, index: int) -> str:
    """The hostname Kubernetes gives pod ``index`` of ``role``'s Indexed Job: ``<job name>-<index>``, where a
    JobSet names its Jobs ``<set>-<replicated job>-<job index>`` (one Job per role here, index 0)."""
    job = f"{options.name}-{k8s_name(role)}-0" if options.kind == "jobset" else f"{options.name}-{k8s_name(role)}"
    return f"{job}-{index}"


def cluster_of(options: K8sOptions) -> ClusterSpec:
    """The job's cluster: every pod by its DNS name (``<hostname>.<service>``) and ``options.port``."""
    jobs = {role: tuple(join_address(f"{pod_host(options, role, i)}.{options.name}", options.port)
                        for i in range(count)) for role, count in roles(options)}
    return ClusterSpec(**jobs)


def manifests(options: K8sOptions, secret: str | None) -> list[dict]:
    """Every object of the job, in the order to create them. ``secret`` (hex digits) is written into a new
    Secret; ``None`` when ``options.secret_name`` names one that exists already."""
    docs: list[dict] = []
    if options.secret_name is None:
        if secret is None:
            raise ValueError("manifests() needs the job secret's hex digits, or options.secret_name")
        docs.append(_object("v1", "Secret", options.secret, options,
                            {"type": "Opaque", "stringData": {SECRET_KEY: secret}}))
    if options.output_size is not None:
        spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": options.output_size}}}
        if options.storage_class:
            spec["storageClassName"] = options.storage_class
        docs.append(_object("v1", "PersistentVolumeClaim", options.output_claim, options, {"spec": spec}))
    if options.network_policy:
        own = {"podSelector": {"matchLabels": _labels(options)}}
        docs.append(_object("networking.k8s.io/v1", "NetworkPolicy", options.name, options, {"spec": {
            **own, "policyTypes": ["Ingress"], "ingress": [{"from": [own]}]}}))
    if options.kind == "jobset":
        docs.append(_jobset(options))
        return docs
    docs.append(_object("v1", "Service", options.name, options, {"spec": {
        "clusterIP": "None", "selector": _labels(options), "publishNotReadyAddresses": True}}))
    for role, count in roles(options):
        docs.append(_object("batch/v1", "Job", f"{options.name}-{k8s_name(role)}", options,
                            {"spec": _job_spec(options, role, count)}, role))
    return docs


def to_yaml(docs: list[dict], header: str = "") -> str:
    """One multi-document YAML text (``kubectl apply -f`` reads it), after ``header`` as comment lines."""
    import yaml  # the `k8s` extra; only `conveyor k8s` needs it

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:  # a shared dict is written out again, never as &id001/*id001
            return True

    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comments + yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, explicit_start=True, width=1 << 16)


def _labels(options: K8sOptions, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "conveyor", "app.kubernetes.io/instance": options.name}
    if role:
        labels["app.kubernetes.io/component"] = role
    return labels


def _object(api: str, kind: str, name: str, options: K8sOptions, body: dict, role: str | None = None) -> dict:
    meta: dict = {"name": name}
    if options.namespace:
        meta["namespace"] = options.namespace
    meta["labels"] = _labels(options, role)
    return {"apiVersion": api, "kind": kind, "metadata": meta, **body}


def _jobset(options: K8sOptions) -> dict:
    training = ["chief"] if options.chief else ["worker"]
    replicated = [{"name": k8s_name(role), "replicas": 1, "template": {"metadata": {"labels": _labels(options, role)},
                                                            "spec": _job_spec(options, role, count)}}
                  for role, count in roles(options)]
    return _object(JOBSET_API, "JobSet", options.name, options, {"spec": {
        "network": {"enableDNSHostnames": True, "subdomain": options.name},
        # The set succeeds when training does: ps tasks exit by themselves then, and need not be awaited.
        "successPolicy": {"operator": "All", "targetReplicatedJobs": training},
        "failurePolicy": {"maxRestarts": options.max_restarts, "rules": [
            {"name": "disrupted", "action": "RestartJobSetAndIgnoreMaxRestarts",
             "onJobFailureReasons": ["PodFailurePolicy"]}]},
        "replicatedJobs": replicated,
    }})


def _job_spec(options: K8sOptions, role: str, count: int) -> dict:
    spec: dict = {"completionMode": "Indexed", "completions": count, "parallelism": count, "backoffLimit": 0}
    if role == "data_worker":  # its death is not the job's: the kubelet restarts it in place (same pod, same IP)
        spec["backoffLimit"] = DATA_WORKER_RESTARTS * count
    elif options.kind == "jobset":  # eviction, preemption, node drain: the failure rule above, not a lost restart
        spec["podFailurePolicy"] = {"rules": [{"action": "FailJob", "onPodConditions": [
            {"type": "DisruptionTarget", "status": "True"}]}]}
    spec["template"] = {"metadata": {"labels": _labels(options, role)}, "spec": _pod_spec(options, role)}
    return spec


def _data_container(options: K8sOptions, role: str) -> dict:
    """A data-service pod's container: `conveyor data serve|worker` on ``options.port``, no GPU, so that the
    scheduler may place data workers on CPU nodes; a worker advertises its pod's IP to the trainers."""
    listen = ["--host", "0.0.0.0", "--port", str(options.port)]
    if role == "dispatcher":
        args = ["serve", *listen, "--report", f"{options.output_dir.rstrip('/')}/logs/data_service.json"]
    else:
        args = ["worker", "--dispatcher", _dispatcher(options), *listen, "--advertise",
                f"$(POD_IP):{options.port}", "--pipeline", str(options.data_pipeline)]
    env = _env(options, "ps")  # what every pod is told, as a task that does not train
    if role == "data_worker":
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return {"name": k8s_name(role), "image": options.image, "command": ["conveyor", "data"], "args": args,
            "env": env, "ports": [{"name": "task", "containerPort": options.port}]}


def _dispatcher(options: K8sOptions) -> str:
    return join_address(f"{pod_host(options, 'dispatcher', 0)}.{options.name}", options.port)


def _pod_spec(options: K8sOptions, role: str) -> dict:
    mounts = [{"name": "output", "mountPath": options.output_dir}]
    volumes: list[dict] = [{"name": "output", "persistentVolumeClaim": {"claimName": options.output_claim}}]
    if options.data_claim:
        mounts.insert(0, {"name": "data", "mountPath": options.data_dir, "readOnly": True})
        volumes.insert(0, {"name": "data", "persistentVolumeClaim": {"claimName": options.data_claim,
                                                                     "readOnly": True}})
    if role in DATA_JOBS:
        container = {**_data_container(options, role), "volumeMounts": mounts}
        return {"subdomain": options.name, "restartPolicy": "OnFailure" if role == "data_worker" else "Never",
                "automountServiceAccountToken": False, "enableServiceLinks": False, "containers": [container],
                "volumes": volumes}
    args = ["--role", role, "--cluster", json.dumps(cluster_of(options).as_dict(), separators=(",", ":")),
            "--master-port", str(options.master_port), *(["--tf-flags"] if options.tf_flags else []),
            options.script, *options.script_args]
    ports = [{"name": "task", "containerPort": options.port}]
    if role != "ps":
        ports.append({"name": "rendezvous", "containerPort": options.master_port})
    container: dict = {"name": role, "image": options.image, "command": ["conveyor", "k8s-task"], "args": args,
                       "env": _env(options, role), "ports": ports, "volumeMounts": mounts}
    if options.gpus and role != "ps":
        container["resources"] = {"limits": {"nvidia.com/gpu": options.gpus}}
    return {"subdomain": options.name, "restartPolicy": "Never", "automountServiceAccountToken": False,
            "enableServiceLinks": False, "containers": [container], "volumes": volumes}


def _env(options: K8sOptions, role: str) -> list[dict]:
    """What every pod of ``role`` is told alike: the job's settings (:meth:`JobSettings.environ`), the secret;
    its own task is derived at start (conveyor k8s-task)."""
    env: list[dict] = [{"name": name, "value": value}
                       for name, value in options.environ(training=role != "ps").items()]
    if options.kind == "jobset":  # JobSet counts the restarts: each attempt's pods carry the count
        restarts = {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{RESTART_ATTEMPT}']"}}}
        env = [{"name": RESTART_COUNT_VAR, **restarts} if e["name"] == RESTART_COUNT_VAR else e for e in env]
    env.append({"name": JOB_SECRET_VAR, "valueFrom": {"secretKeyRef": {"name": options.secret, "key": SECRET_KEY}}})
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})  # kubectl logs shows lines as they are printed
    if options.data_workers:
        env.append({"name": DATA_SERVICE_VAR, "value": _dispatcher(options)})
    return env
