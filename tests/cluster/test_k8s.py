"""`conveyor k8s`: the manifests validate against Kubernetes' OpenAPI schema, every pod finds its task from
its index, and the pods, run on hosts of their own as Kubernetes would run them, train the digits job."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conveyor.cli.main import build_parser, main
from conveyor.cluster import ClusterConfigError, TaskId, discover
from conveyor.cluster.settings import JobSettings
from conveyor.errors import RendezvousError
from conveyor.launch.k8s import JOBSET_API, K8sOptions, cluster_of, manifests
from conveyor.launch.pod import pod_launch, wait_for_hosts
from kubelet import Kubelet, NotModelled, check_fields

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "digits" / "train.py"
IMAGE = "registry.example.com/conveyor-digits:1"
SECRET = "5e" * 32
#: The oldest Kubernetes whose Job API has everything the manifests use (podFailurePolicy: beta in 1.26, on
#: by default), and the newest schema kubernetes-validate ships.
VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())

# JobSet is a CRD, not in the core schema: its own fields are checked against this schema, written from
# jobset.x-k8s.io/v1alpha2's types (api/jobset/v1alpha2/jobset_types.go), and the Job template inside each
# replicated Job against the core batch/v1 Job schema.
_STRINGS = {"type": "array", "items": {"type": "string"}}
_OBJECT = {"type": "object", "additionalProperties": False}
JOBSET_SCHEMA = {**_OBJECT, "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
    "apiVersion": {"const": JOBSET_API}, "kind": {"const": "JobSet"}, "metadata": {"type": "object"},
    "spec": {**_OBJECT, "required": ["replicatedJobs"], "properties": {
        "network": {**_OBJECT, "properties": {"enableDNSHostnames": {"type": "boolean"}, "subdomain": {
            "type": "string"}, "publishNotReadyAddresses": {"type": "boolean"}}},
        "successPolicy": {**_OBJECT, "required": ["operator"], "properties": {
            "operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _STRINGS}},
        "failurePolicy": {**_OBJECT, "properties": {
            "maxRestarts": {"type": "integer", "minimum": 0},
            "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
            "rules": {"type": "array", "items": {**_OBJECT, "required": ["name", "action"], "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"},
                "action": {"enum": ["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts",
                                    "RestartJob", "RestartJobAndIgnoreMaxRestarts"]},
                "onJobFailureReasons": _STRINGS, "onJobFailureMessagePatterns": _STRINGS,
                "targetReplicatedJobs": _STRINGS}}}}},
        "replicatedJobs": {"type": "array", "minItems": 1, "items": {**_OBJECT, "required": ["name", "template"],
                           "properties": {"name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"},
                                          "replicas": {"type": "integer", "minimum": 1},
                                          "template": {"type": "object"}}}},
    }},
}}

VARIANTS = {
    "ps": dict(workers=2, ps=1, strategy="ps-sync", data_claim="digits-data", tf_flags=True),
    "chief-gpus": dict(workers=3, ps=2, chief=True, strategy="ps-async", gpus=1, namespace="ml", output_size="20Gi",
                       storage_class="nfs-client", secret_name="shared-secret", tf_flags=False, resume=False),
    "allreduce": dict(workers=4, data_claim="digits-data", timeout=60, max_restarts=0, network_policy=False),
    "data-service": dict(workers=2, gpus=1, data_claim="digits-data", data_workers=3,
                         data_pipeline="digits.input:train"),
}


def options(kind: str = "jobset", **changes) -> K8sOptions:
    base = dict(name="digits", image=IMAGE, script="/app/train.py", script_args=("--epochs", "1"),
                output_claim="digits-output", kind=kind)
    return K8sOptions(**{**base, **changes})


def generated(tmp_path: Path, *argv: str) -> list[dict]:
    """The documents `conveyor k8s ARGV` writes, read back as kubectl reads the file."""
    path = tmp_path / "job.yaml"
    assert main(["k8s", "-f", str(path), *argv]) == 0
    return list(yaml.safe_load_all(path.read_text()))


@pytest.mark.parametrize("kind", ["jobset", "jobs"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifests_validate_against_the_kubernetes_openapi_schema(kind, variant):
    text = yaml.safe_dump_all(manifests(options(kind, **VARIANTS[variant]), SECRET))
    docs = list(yaml.safe_load_all(text))
    kinds = [doc["kind"] for doc in docs]
    assert kinds.count("JobSet" if kind == "jobset" else "Job") >= 1
    for version in VERSIONS:
        for doc in docs:
            if doc["kind"] != "JobSet":
                kubernetes_validate.validate(doc, version, strict=True)
                continue
            jsonschema.validate(doc, JOBSET_SCHEMA)
            for rjob in doc["spec"]["replicatedJobs"]:
                job = {"apiVersion": "batch/v1", "kind": "Job", "spec": rjob["template"]["spec"],
                       "metadata": {"name": f"{doc['metadata']['name']}-{rjob['name']}-0",
                                    **rjob["template"]["metadata"]}}
                kubernetes_validate.validate(job, version, strict=True)


def test_the_schema_check_is_strict():
    doc = manifests(options("jobs"), SECRET)[-1]
    doc["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="envv"):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    jobset = manifests(options(), SECRET)[-1]
    jobset["spec"]["failurePolicy"]["maxRestart"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxRestart"):
        jsonschema.validate(jobset, JOBSET_SCHEMA)
    with pytest.raises(NotModelled, match="envv"):
        check_fields({"envv": []}, {"env": None}, "container")


@pytest.mark.parametrize(("kind", "worker1"), [("jobset", "digits-worker-0-1.digits:2222"),
                                               ("jobs", "digits-worker-1.digits:2222")])
def test_every_pod_finds_its_task_from_its_index_as_kubernetes_starts_it(tmp_path, kind, worker1):
    docs = generated(tmp_path, "--kind", kind, "--name", "digits", "--image", IMAGE, "-n", "3", "--chief", "--ps",
                     "2", "--output-claim", "out", "/app/train.py", "--epochs", "1")
    kubelet = Kubelet(docs, images={IMAGE: {"PATH": "/usr/bin", "RANK": "7"}}, claims={}, root=tmp_path)
    spec = cluster_of(options(kind, workers=3, chief=True, ps=2))
    assert spec.worker[1] == worker1 and len(kubelet.pods) == 5
    found = []
    for pod in kubelet.pods:
        command = kubelet.command(pod)
        args = build_parser().parse_args(command[1:])
        assert command[:2] == ["conveyor", "k8s-task"] and args.script == "/app/train.py"
        launch = pod_launch(kubelet.environment(pod), role=args.role, cluster=args.cluster,
                            master_port=args.master_port, script=args.script, script_args=args.script_args,
                            python="python3", hostname=pod.hostname)
        assert launch.argv == ("python3", "/app/train.py", "--epochs", "1")
        assert set(launch.hosts) == {p.dns_name for p in kubelet.pods}
        me = discover(launch.env)
        assert me.source == "conveyor" and me.spec == spec and me.secret == bytes.fromhex(kubelet.secrets[
            "digits-secret"]["secret"])
        assert f"{pod.dns_name}:2222" == spec.task_address(me.task.type, me.task.index)
        if me.rank is not None:
            assert (me.world_size, me.master_addr, me.master_port) == (3, spec.chief[0].split(":")[0], 29500)
        found.append((str(me.task), me.rank))
    assert found == [("chief:0", 0), ("worker:0", 1), ("worker:1", 2), ("ps:0", None), ("ps:1", None)]
    restarted = kubelet.pods[0]
    restarted.annotations["jobset.sigs.k8s.io/restart-attempt"] = "2"  # JobSet's third attempt
    expected = "2" if kind == "jobset" else "0"  # plain Jobs are never restarted together
    assert kubelet.environment(restarted)["CONVEYOR_RESTART_COUNT"] == expected


@pytest.mark.parametrize("kind", ["jobset", "jobs"])
def test_a_pipeline_job_carries_its_pipeline_settings_to_every_task(tmp_path, kind):
    docs = generated(tmp_path, "--kind", kind, "--name", "pipe", "--image", IMAGE, "-n", "4", "--strategy",
                     "pipeline", "--stages", "2", "--microbatches", "8", "--schedule", "gpipe", "--timeout", "60",
                     "--output-claim", "out", "/app/train.py")
    kubelet = Kubelet(docs, images={IMAGE: {"PATH": "/usr/bin"}}, claims={}, root=tmp_path)
    assert len(kubelet.pods) == 4
    for doc in docs:
        if doc["kind"] == "JobSet":
            jsonschema.validate(doc, JOBSET_SCHEMA)
        else:
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    ranks = []
    for pod in kubelet.pods:
        args = build_parser().parse_args(kubelet.command(pod)[1:])
        launch = pod_launch(kubelet.environment(pod), role=args.role, cluster=args.cluster,
                            master_port=args.master_port, script=args.script, python="python3", hostname=pod.hostname)
        settings = JobSettings.from_environ(launch.env)
        assert (str(settings.strategy), settings.stages, settings.microbatches, settings.schedule, settings.split,
                settings.timeout) == ("pipeline", 2, 8, "gpipe", None, 60.0)
        ranks.append(discover(launch.env).rank)
    assert ranks == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="-n 3 --stages 2: each pipeline replica runs all 2 stages"):
        options(workers=3, strategy="pipeline", stages=2)
    with pytest.raises(ValueError, match="--stages belong"):
        options(workers=2, stages=2)


def test_a_pod_that_is_not_what_its_cluster_says_fails_naming_why(tmp_path):
    docs = generated(tmp_path, "--name", "digits", "--image", IMAGE, "-n", "2", "--output-claim", "out", "t.py")
    kubelet = Kubelet(docs, images={IMAGE: {}}, claims={}, root=tmp_path)
    pod = kubelet.pods[1]
    env = kubelet.environment(pod)
    cluster = json.dumps(cluster_of(options(workers=2)).as_dict())
    launch = dict(role="worker", cluster=cluster, master_port=29500, script="t.py", hostname=pod.hostname)
    assert pod_launch(env, **launch).task == TaskId("worker", 1)
    cases = [({"JOB_COMPLETION_INDEX": ""}, {}, "JOB_COMPLETION_INDEX is not set.*Indexed Job"),
             ({"JOB_COMPLETION_INDEX": "2"}, {}, "JOB_COMPLETION_INDEX = 2 is out of range"),
             ({}, {"hostname": "digits-worker-1"}, "hostname is 'digits-worker-1'.*renamed"),
             ({"CONVEYOR_JOB_SECRET": "abc"}, {}, "32 hex digits"),
             ({"CONVEYOR_STRATEGY": ""}, {}, "CONVEYOR_STRATEGY is not set in this pod"),
             ({}, {"cluster": "worker=a:1"}, "--cluster 'worker=a:1'"),
             ({}, {"role": "ps"}, "--role = 'ps' but the cluster has no 'ps' job")]
    for env_change, arg_change, message in cases:
        with pytest.raises(ClusterConfigError, match=message):
            pod_launch({**env, **env_change}, **{**launch, **arg_change})


def test_a_pod_waits_for_every_name_and_gives_up_naming_those_missing():
    now, notes, up = [0.0], [], {"a.job"}

    def resolve(host):
        if host not in up:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def sleep(seconds):
        now[0] += seconds
        if now[0] >= 12:
            up.add("b.job")

    wait_for_hosts(["a.job", "b.job"], 60, note=notes.append, resolve=resolve, clock=lambda: now[0], sleep=sleep)
    assert now[0] >= 12 and notes == ["waiting for b.job to resolve (pods not running yet?)"]
    now[0] = 0.0
    with pytest.raises(RendezvousError, match=r"1 pod name\(s\) did not resolve within 5 s: c.job.*kubectl get"):
        wait_for_hosts(["a.job", "c.job"], 5, resolve=resolve, clock=lambda: now[0], sleep=sleep)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(name="Digits"), "--name 'Digits': expected lower-case"),
    (dict(name="d" * 53), "longest pod name \\(64 characters now\\)"),
    (dict(strategy="pipeline"), "pipeline"),
    (dict(ps=1, strategy="allreduce"), "--ps 1 starts parameter servers"),
    (dict(kind="deployment"), "--kind 'deployment'"),
    (dict(data_dir="data"), "--data-dir 'data': expected an absolute folder"),
    (dict(data_dir="/output/"), "two volumes need two folders"),
    (dict(output_size="lots"), "--output-size 'lots'"),
    (dict(data_claim="Data_1"), "--data-claim 'Data_1'"),
    (dict(namespace="a.b"), "--namespace 'a.b'"),
    (dict(gpus=-1), "--gpus -1"),
    (dict(gpus=2), "--gpus 2: a pod runs one training process"),
    (dict(data_workers=-1), "--data-workers -1"),
    (dict(data_workers=2), "--data-workers K and --data-pipeline MODULE:FUNCTION go together"),
])
def test_bad_options_name_the_flag(changes, message):
    with pytest.raises(ValueError, match=message):
        options(**changes)


@pytest.mark.parametrize("kind", ["jobset", "jobs"])
def test_data_workers_are_pods_of_their_own_without_gpus_and_every_pod_finds_the_dispatcher(tmp_path, kind):
    docs = generated(tmp_path, "--name", "digits", "--image", IMAGE, "--output-claim", "out", "--kind", kind,
                     "-n", "2", "--gpus", "1", "--data-workers", "3", "--data-pipeline", "digits.input:train",
                     "/app/train.py")
    if kind == "jobset":
        [jobset] = [d for d in docs if d["kind"] == "JobSet"]
        jobs = {r["name"]: r["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]}
        assert jobset["spec"]["successPolicy"]["targetReplicatedJobs"] == ["worker"]  # not the serving pods
        host = "digits-dispatcher-0-0.digits:2222"
    else:
        jobs = {d["metadata"]["name"].removeprefix("digits-"): d["spec"] for d in docs if d["kind"] == "Job"}
        host = "digits-dispatcher-0.digits:2222"
    assert sorted(jobs) == ["data-worker", "dispatcher", "worker"]
    containers = {name: job["template"]["spec"]["containers"][0] for name, job in jobs.items()}
    for name, container in containers.items():
        assert {"name": "CONVEYOR_DATA_SERVICE", "value": host} in container["env"]
        assert ("resources" in container) == (name == "worker")  # only the trainers ask for a GPU
    data = jobs["data-worker"]
    assert data["completions"] == 3 and data["backoffLimit"] == 9 and "podFailurePolicy" not in data
    assert data["template"]["spec"]["restartPolicy"] == "OnFailure"  # restarted in place: not the job's failure
    assert jobs["dispatcher"]["backoffLimit"] == 0 and jobs["dispatcher"]["template"]["spec"]["restartPolicy"] == \
        "Never"  # its failure is the job's: the set restarts from the checkpoint
    worker = containers["data-worker"]
    assert worker["command"] == ["conveyor", "data"] and worker["args"] == [
        "worker", "--dispatcher", host, "--host", "0.0.0.0", "--port", "2222", "--advertise", "$(POD_IP):2222",
        "--pipeline", "digits.input:train"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in worker["env"]
    assert containers["dispatcher"]["args"][:5] == ["serve", "--host", "0.0.0.0", "--port", "2222"]
    spec = json.loads(containers["worker"]["args"][3])
    assert spec["dispatcher"] == [host] and len(spec["data_worker"]) == 3


def test_the_file_holds_the_secret_so_only_its_owner_reads_it(tmp_path, capsys):
    docs = generated(tmp_path, "--name", "digits", "--image", IMAGE, "--output-claim", "out", "t.py")
    assert stat.S_IMODE(os.stat(tmp_path / "job.yaml").st_mode) == 0o600
    assert len(bytes.fromhex(docs[0]["stringData"]["secret"])) == 32
    assert "kubectl apply -f" in capsys.readouterr().err
    docs = generated(tmp_path, "--name", "digits", "--image", IMAGE, "--output-claim", "out", "--secret-name", "s",
                     "t.py")
    assert "Secret" not in [d["kind"] for d in docs]
    assert main(["k8s", "--name", "x", "--image", "i", "--output-claim", "o", "--workers", "0", "t.py"]) == 2
    assert "--workers 0: expected a whole number >= 1" in capsys.readouterr().err


def test_without_pyyaml_the_command_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    assert main(["k8s", "--name", "x", "--image", "i", "--output-claim", "o", "t.py"]) == 2
    assert "pip install 'conveyor[k8s]'" in capsys.readouterr().err


# -- the pods, run ----------------------------------------------------------------------------------


def _write_digits(folder: Path) -> None:
    spec = importlib.util.spec_from_file_location("digits_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_tfrecords(str(folder / "digits"))


def _wait_for(condition, deadline: float, what: str) -> None:
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, f"{what}: not within {deadline:g} s"
        time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_pods_train_the_digits_job_on_hosts_of_their_own_and_restart_together(make_hosts, tmp_path):
    """Every pod of a 2-worker, 1-ps ps-sync JobSet runs its container command on a host of its own, with
    the env, hostname, hosts entries and mounts Kubernetes gives it. A worker's host dies after the first
    checkpoint; every pod is recreated as JobSet does, and the job resumes, finishes, and every pod exits 0."""
    volumes = {"digits-data": tmp_path / "volumes" / "data", "digits-output": tmp_path / "volumes" / "output"}
    for folder in volumes.values():
        folder.mkdir(parents=True)
    _write_digits(volumes["digits-data"])  # the claim arrives filled: the pods see it read-only
    docs = generated(tmp_path, "--name", "digits", "--image", IMAGE, "-n", "2", "--ps", "1", "--strategy", "ps-sync",
                     "--data-claim", "digits-data", "--output-claim", "digits-output", "--timeout", "120",
                     "--data-dir", str(tmp_path / "pod" / "data"), "--output-dir", str(tmp_path / "pod" / "output"),
                     str(SCRIPT), "--epochs", "2", "--lr", "0.2", "--checkpoint-every", "10")
    image = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"),
             "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    kubelet = Kubelet(docs, images={IMAGE: image}, claims=volumes, root=tmp_path, cwd=tmp_path)
    hosts = make_hosts(len(kubelet.pods), names=kubelet.host_names(), private_hostnames=True)
    denied = kubelet.exec(hosts, kubelet.pods[0], ["touch", str(tmp_path / "pod" / "data" / "x")])
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    out = volumes["digits-output"]
    kubelet.start(hosts, logs=tmp_path / "logs")
    _wait_for(lambda: (out / "checkpoints" / "latest").exists(), 150, "the first checkpoint")
    hosts.kill_host(hosts[1])  # digits-worker-0-1's node is gone
    assert kubelet.pods[1] in kubelet.wait(deadline=60), kubelet.logs()
    kubelet.restart()
    assert kubelet.wait(deadline=180) == [], kubelet.logs()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["restarts"] == 1 and summary["eval_accuracy"] > 0.85, summary
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / latest / "ps-0.safetensors").exists()  # the ps pod wrote into the same claim
    logs = kubelet.logs(tail=10**6)
    assert "pod digits-worker-0-1 is worker:1 of {'worker': ['digits-worker-0-0.digits:2222'" in logs
    assert "resumed from step" in logs and "ps:0: every worker is done" in logs
