"""A tiny Kubernetes for tests: the pods that `conveyor k8s`'s manifests describe, each run on a test host.

    kubelet = Kubelet(docs, images={"img:1": image_env}, claims={"digits-data": folder, ...}, root=tmp_path)
    hosts = make_hosts(len(kubelet.pods), names=kubelet.host_names(), private_hostnames=True)
    kubelet.start(hosts, logs=tmp_path / "logs")
    failed = kubelet.wait(deadline=120)       # [] when every pod exited 0; else kubelet.restart(), as JobSet does

It plays the Job and JobSet controllers (Indexed Jobs: one pod per completion index, all at once, with
the ``batch.kubernetes.io/job-completion-index`` annotation and ``JOB_COMPLETION_INDEX``; JobSet's Job
names, DNS subdomain and ``restart-attempt`` annotation) and the kubelet (the image's environment, then
the container's env with secretKeyRef and fieldRef resolved; hostname ``<job>-<index>``; the pod's own
hostname in its /etc/hosts and every pod's ``<hostname>.<subdomain>`` as cluster DNS would answer;
PersistentVolumeClaims bind-mounted at their mount paths, read-only where asked). It knows exactly the
fields those manifests use: any other field fails the test, so a manifest cannot pass by carrying
something this model ignores. ``restart`` recreates every pod as JobSet does after a failure.
"""

from __future__ import annotations

import base64
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

LEAF = None  # a field whose value is read as is
#: Every field the model understands, by object; a list holds the schema of its items.
POD_SPEC = {
    "subdomain": LEAF, "restartPolicy": LEAF, "automountServiceAccountToken": LEAF, "enableServiceLinks": LEAF,
    "containers": [{
        "name": LEAF, "image": LEAF, "command": LEAF, "args": LEAF,
        "env": [{"name": LEAF, "value": LEAF, "valueFrom": {"secretKeyRef": {"name": LEAF, "key": LEAF},
                                                            "fieldRef": {"fieldPath": LEAF}}}],
        "ports": [{"name": LEAF, "containerPort": LEAF}],
        "volumeMounts": [{"name": LEAF, "mountPath": LEAF, "readOnly": LEAF}],
        "resources": {"limits": {"nvidia.com/gpu": LEAF}},
    }],
    "volumes": [{"name": LEAF, "persistentVolumeClaim": {"claimName": LEAF, "readOnly": LEAF}}],
}
LABELS = {"labels": {"app.kubernetes.io/name": LEAF, "app.kubernetes.io/instance": LEAF,
                     "app.kubernetes.io/component": LEAF}}
META = {"name": LEAF, "namespace": LEAF, **LABELS}
JOB_SPEC = {"completionMode": LEAF, "completions": LEAF, "parallelism": LEAF, "backoffLimit": LEAF,
            "podFailurePolicy": {"rules": [{"action": LEAF, "onPodConditions": [{"type": LEAF, "status": LEAF}]}]},
            "template": {"metadata": LABELS, "spec": POD_SPEC}}
KINDS = {
    "Secret": {"type": LEAF, "stringData": LEAF, "data": LEAF},
    "PersistentVolumeClaim": {"spec": {"accessModes": LEAF, "resources": {"requests": {"storage": LEAF}},
                                       "storageClassName": LEAF}},
    "Service": {"spec": {"clusterIP": LEAF, "selector": LEAF, "publishNotReadyAddresses": LEAF}},
    # The hosts reach only each other: the policy's "the job's pods only", without modelling it further.
    "NetworkPolicy": {"spec": {"podSelector": {"matchLabels": LEAF}, "policyTypes": LEAF,
                               "ingress": [{"from": [{"podSelector": {"matchLabels": LEAF}}]}]}},
    "Job": {"spec": JOB_SPEC},
    "JobSet": {"spec": {
        "network": {"enableDNSHostnames": LEAF, "subdomain": LEAF},
        "successPolicy": {"operator": LEAF, "targetReplicatedJobs": LEAF},
        "failurePolicy": {"maxRestarts": LEAF, "rules": [{"name": LEAF, "action": LEAF,
                                                          "onJobFailureReasons": LEAF}]},
        "replicatedJobs": [{"name": LEAF, "replicas": LEAF, "template": {"metadata": LABELS, "spec": JOB_SPEC}}],
    }},
}
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
RESTART_ANNOTATION = "jobset.sigs.k8s.io/restart-attempt"
_FIELD_REF = re.compile(r"metadata\.(annotations|labels)\['([^']+)'\]")


class NotModelled(AssertionError):
    """The manifests use something this model does not understand."""


def check_fields(obj: object, schema: object, where: str) -> None:
    """Fail on any field of ``obj`` that ``schema`` does not list."""
    if schema is LEAF:
        return
    if isinstance(schema, list):
        if not isinstance(obj, list):
            raise NotModelled(f"{where}: expected a list, got {obj!r}")
        for i, item in enumerate(obj):
            check_fields(item, schema[0], f"{where}[{i}]")
        return
    if not isinstance(obj, dict):
        raise NotModelled(f"{where}: expected an object, got {obj!r}")
    for key, value in obj.items():
        if key not in schema:
            raise NotModelled(f"{where}.{key}: a field this model does not understand")
        check_fields(value, schema[key], f"{where}.{key}")


@dataclass
class Pod:
    """One pod as the controllers create it."""

    hostname: str
    subdomain: str
    job: str
    role: str
    annotations: dict[str, str]
    labels: dict[str, str]
    spec: dict
    proc: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = None

    @property
    def dns_name(self) -> str:
        return f"{self.hostname}.{self.subdomain}"


class Kubelet:
    """The pods of ``docs``; see the module docstring."""

    def __init__(self, docs: list[dict], *, images: dict[str, dict[str, str]], claims: dict[str, Path],
                 root: Path, cwd: Path | None = None) -> None:
        self.images, self.claims, self.root, self.cwd = images, claims, root.resolve(), cwd
        self.secrets: dict[str, dict[str, str]] = {}
        self.services: list[dict] = []
        self.pods: list[Pod] = []
        self.hosts = None  # the test hosts the pods run on, once started
        for doc in docs:
            kind = doc.get("kind")
            if kind not in KINDS or set(doc) - {"apiVersion", "kind", "metadata", *KINDS[kind]}:
                raise NotModelled(f"{kind} {doc.get('metadata', {}).get('name')}: not modelled ({sorted(doc)})")
            check_fields(doc["metadata"], META, f"{kind}.metadata")
            check_fields({k: v for k, v in doc.items() if k in KINDS[kind]}, KINDS[kind], kind)
            getattr(self, f"_add_{kind}", lambda d: None)(doc)
        self._check_dns()

    # -- the controllers ---------------------------------------------------------------------------

    def _add_Secret(self, doc: dict) -> None:
        values = dict(doc.get("stringData") or {})
        values.update({k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()})
        self.secrets[doc["metadata"]["name"]] = values

    def _add_Service(self, doc: dict) -> None:
        assert doc["spec"]["clusterIP"] == "None", "pod DNS names need a headless Service"
        self.services.append(doc)

    def _add_Job(self, doc: dict, annotations: dict[str, str] | None = None, role: str | None = None) -> None:
        spec, name = doc["spec"], doc["metadata"]["name"]
        if spec.get("completionMode") != "Indexed":
            raise NotModelled(f"Job {name}: only Indexed Jobs give pods an index and a stable hostname")
        if spec["completions"] != spec["parallelism"]:
            raise NotModelled(f"Job {name}: completions != parallelism; this model starts every index at once")
        template = spec["template"]
        for index in range(spec["completions"]):
            self.pods.append(Pod(
                hostname=f"{name}-{index}", subdomain=template["spec"].get("subdomain", ""), job=name,
                role=role or template["metadata"]["labels"]["app.kubernetes.io/component"],
                annotations={**(annotations or {}), INDEX_ANNOTATION: str(index)},
                labels=dict(template["metadata"]["labels"]), spec=template["spec"]))

    def _add_JobSet(self, doc: dict) -> None:
        spec, name = doc["spec"], doc["metadata"]["name"]
        network = spec["network"]
        assert network["enableDNSHostnames"] is True, "JobSet pods get DNS names only with enableDNSHostnames"
        subdomain = network.get("subdomain", name)
        self.services.append({"metadata": {"name": subdomain}, "spec": {"selector": {}}})  # JobSet makes it
        success = spec.get("successPolicy", {"operator": "All", "targetReplicatedJobs": []})
        assert success["operator"] == "All", "this model knows the 'All' success policy"
        names = {r["name"] for r in spec["replicatedJobs"]}
        assert set(success["targetReplicatedJobs"]) <= names, "the success policy names a replicated job"
        for rjob in spec["replicatedJobs"]:
            for j in range(rjob["replicas"]):
                job = {"metadata": {"name": f"{name}-{rjob['name']}-{j}"}, "spec": rjob["template"]["spec"]}
                tpl_spec = job["spec"]["template"]["spec"]
                assert tpl_spec.get("subdomain", subdomain) == subdomain, "JobSet sets the pods' subdomain"
                tpl_spec.setdefault("subdomain", subdomain)
                self._add_Job(job, {RESTART_ANNOTATION: "0", "jobset.sigs.k8s.io/jobset-name": name,
                                    "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                                    "jobset.sigs.k8s.io/job-index": str(j)}, rjob["name"])

    def _check_dns(self) -> None:
        """A pod's ``<hostname>.<subdomain>`` exists only when a headless Service of that name selects it."""
        for pod in self.pods:
            services = [s for s in self.services if s["metadata"]["name"] == pod.subdomain]
            assert pod.subdomain and services, f"pod {pod.hostname}: no headless Service named its subdomain"
            selector = services[0]["spec"]["selector"]
            assert all(pod.labels.get(k) == v for k, v in selector.items()), f"{pod.hostname}: Service misses it"

    # -- the kubelet -------------------------------------------------------------------------------

    def host_names(self) -> list[tuple[str, ...]]:
        """Each pod's hostname and the names cluster DNS answers for it (for ``Hosts(names=...)``)."""
        return [(p.hostname, p.dns_name, f"{p.dns_name}.default.svc.cluster.local") for p in self.pods]

    def environment(self, pod: Pod) -> dict[str, str]:
        """The container's environment: the image's, HOSTNAME, then its env, then the Job controller's index."""
        container = self._container(pod)
        env = {**self.images[container["image"]], "HOSTNAME": pod.hostname}
        for var in container.get("env", []):
            env[var["name"]] = self._value(pod, var)
        env["JOB_COMPLETION_INDEX"] = pod.annotations[INDEX_ANNOTATION]
        return env

    def command(self, pod: Pod) -> list[str]:
        """The container's command and arguments."""
        container = self._container(pod)
        command = [*container["command"], *container.get("args", [])]
        if any("$(" in arg for arg in command):
            raise NotModelled(f"{pod.hostname}: $(VAR) expansion in command/args")
        return command

    def argv(self, pod: Pod) -> list[str]:
        """The container's command, its mounts made first (in the pod's own mount namespace)."""
        container, command = self._container(pod), self.command(pod)
        steps = ["set -e"]
        volumes = {v["name"]: v["persistentVolumeClaim"] for v in pod.spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            claim = volumes[mount["name"]]
            source, target = self.claims[claim["claimName"]], Path(mount["mountPath"]).resolve()
            assert target.is_relative_to(self.root), f"mount path {target} is outside the test's folder"
            target.mkdir(parents=True, exist_ok=True)
            steps.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}")
            if mount.get("readOnly") or claim.get("readOnly"):
                steps.append(f"mount -o remount,bind,ro {shlex.quote(str(target))}")
        if self.cwd is not None:
            steps.append(f"cd {shlex.quote(str(self.cwd))}")
        return ["sh", "-c", "; ".join(steps) + '; exec "$@"', pod.hostname, *command]

    def start(self, hosts, logs: Path) -> None:
        """Start every pod on its host (``hosts[i]`` for ``pods[i]``), its output in ``logs/<hostname>.log``."""
        self.hosts = hosts
        logs.mkdir(parents=True, exist_ok=True)
        for pod, host in zip(self.pods, hosts, strict=True):
            assert host.name == pod.hostname
            pod.log = logs / f"{pod.hostname}.log"
            with open(pod.log, "ab") as out:
                pod.proc = hosts.popen(host, self.argv(pod), env=self.environment(pod), stdout=out,
                                       stderr=subprocess.STDOUT)

    def restart(self) -> None:
        """What JobSet does when a Job failed: delete every pod (SIGTERM, a grace period, SIGKILL), then create
        them all again with ``restart-attempt`` + 1 (a JobSet's pods only: plain Jobs are not restarted)."""
        assert all(RESTART_ANNOTATION in pod.annotations for pod in self.pods), "only a JobSet restarts its pods"
        for pod in self.pods:
            if pod.proc.poll() is None:
                pod.proc.terminate()
        for pod, host in zip(self.pods, self.hosts, strict=True):
            try:
                pod.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.hosts.kill_host(host)  # whatever the pod left (data-loader workers) goes with it
            pod.proc.wait(timeout=10)
            pod.annotations[RESTART_ANNOTATION] = str(int(pod.annotations[RESTART_ANNOTATION]) + 1)
            with open(pod.log, "ab") as out:
                out.write(f"=== JobSet restart attempt {pod.annotations[RESTART_ANNOTATION]} ===\n".encode())
        self.start(self.hosts, self.pods[0].log.parent)

    def exec(self, hosts, pod: Pod, argv: list[str]) -> subprocess.CompletedProcess:
        """``kubectl exec``: ``argv`` in a fresh container of ``pod`` (same mounts, env and host)."""
        host = hosts[self.pods.index(pod)]
        wrapped = self.argv(pod)[:4] + argv
        return hosts.run(host, wrapped, env=self.environment(pod), capture_output=True, text=True, timeout=30)

    def wait(self, deadline: float) -> list[Pod]:
        """The pods that failed, as soon as one has (where a JobSet restarts every pod); ``[]`` once every pod
        has exited 0 (the ps pods too: they end when the workers are done). Fails after ``deadline`` s."""
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            codes = [p.proc.poll() for p in self.pods]
            failed = [p for p, code in zip(self.pods, codes, strict=True) if code not in (None, 0)]
            if failed or all(code == 0 for code in codes):
                return failed
            time.sleep(0.1)
        raise AssertionError(f"pods still running after {deadline:g} s:\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.hostname}\n{p.log.read_text(errors='replace')[-tail:]}"
                         for p in self.pods if p.log and p.log.exists())

    def _container(self, pod: Pod) -> dict:
        containers = pod.spec["containers"]
        assert len(containers) == 1, "one container per pod"
        container = containers[0]
        assert container["image"] in self.images, f"image {container['image']} is not in this model"
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)
        assert not gpus, "this node has no GPUs"
        assert pod.spec["restartPolicy"] == "Never", "a failed container must fail its pod (no in-place restart)"
        return container

    def _value(self, pod: Pod, var: dict) -> str:
        if "value" in var:
            return str(var["value"])
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self.secrets[ref["name"]][ref["key"]]
        match = _FIELD_REF.fullmatch(source["fieldRef"]["fieldPath"])
        if match is None:
            raise NotModelled(f"fieldRef {source['fieldRef']['fieldPath']}")
        values = pod.annotations if match.group(1) == "annotations" else pod.labels
        return values.get(match.group(2), "")
