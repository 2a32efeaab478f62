"""The Kubernetes JobSet and TrainJob (Kubeflow Trainer v2) and the SkyPilot task in tools/cluster/ parse and hold what their schemas require
(a small schema here: no client library offline), agree with themselves (nodes, GPUs, the first pod's DNS
name, the grace period from [train].preempt_timeout_s), and start the same torchrun line as
tools/cluster/pretrain.sbatch, whose line tests/test_cluster_slurm.py trains with: each file's command is
run here with ``PRETRAIN_PYTHON`` a stub that records its arguments (no torch)."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "tools" / "cluster"
STUBS = Path(__file__).parent / "slurm_stub"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CONTAINER_KEYS = {"name", "image", "command", "args", "workingDir", "env", "resources", "volumeMounts", "ports",
                  "securityContext", "imagePullPolicy"}
SKYPILOT_KEYS = {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts", "setup", "run",
                 "config", "volumes", "event_callback"}


def _load(name: str) -> dict:
    return yaml.safe_load((FILES / name).read_text())


def _pod(jobset: dict) -> dict:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def test_the_jobset_holds_what_its_schema_requires_and_agrees_with_itself():
    from pretrain.commands.cluster import EXIT_MARGIN_S
    from pretrain.config import load_config

    js = _load("jobset.yaml")
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    name = js["metadata"]["name"]
    [rjob] = js["spec"]["replicatedJobs"]
    job, pod = rjob["template"]["spec"], _pod(js)
    assert DNS_LABEL.match(name) and DNS_LABEL.match(rjob["name"]) and rjob.get("replicas", 1) == 1
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never" and js["spec"]["failurePolicy"]["maxRestarts"] > 0
    [container] = pod["containers"]
    assert set(container) <= CONTAINER_KEYS and DNS_LABEL.match(container["name"]) and container["image"]
    assert all(isinstance(word, str) for word in container["command"])
    env = {e["name"]: e["value"] for e in container["env"]}
    assert all(isinstance(v, str) for v in env.values())  # Kubernetes takes strings only
    assert int(env["NNODES"]) == job["parallelism"]
    assert int(env["GPUS_PER_NODE"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert env["MASTER_ADDR"] == f"{name}-{rjob['name']}-0-0.{name}"  # the first pod, by JobSet's DNS names
    assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}
    preempt = load_config(None, []).train.preempt_timeout_s
    assert int(env["PREEMPT_TIMEOUT_S"]) == preempt
    assert pod["terminationGracePeriodSeconds"] == preempt + EXIT_MARGIN_S


TRAINJOB_TRAINER_KEYS = {"image", "command", "args", "env", "numNodes", "resourcesPerNode", "numProcPerNode"}
RUNTIME_POD_KEYS = {"restartPolicy", "terminationGracePeriodSeconds", "containers", "volumes", "initContainers",
                    "nodeSelector", "tolerations", "serviceAccountName"}


def _trainjob() -> tuple[dict, dict]:
    """tools/cluster/trainjob.yaml: its TrainingRuntime and its TrainJob."""
    runtime, job = yaml.safe_load_all((FILES / "trainjob.yaml").read_text())
    return runtime, job


def test_the_trainjob_holds_what_its_schema_requires_and_agrees_with_itself_and_the_jobset():
    from pretrain.commands.cluster import EXIT_MARGIN_S
    from pretrain.config import load_config

    runtime, job = _trainjob()
    assert {d["apiVersion"] for d in (runtime, job)} == {"trainer.kubeflow.org/v1alpha1"}
    assert (runtime["kind"], job["kind"]) == ("TrainingRuntime", "TrainJob")
    name = job["metadata"]["name"]
    assert DNS_LABEL.match(name) and DNS_LABEL.match(runtime["metadata"]["name"])
    assert job["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"], "apiGroup": "trainer.kubeflow.org",
                                         "kind": "TrainingRuntime"}
    [rjob] = runtime["spec"]["template"]["spec"]["replicatedJobs"]  # the trainer's job: named "node", as is its container
    assert rjob["name"] == "node" and rjob["template"]["metadata"]["labels"][
        "trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert set(pod) <= RUNTIME_POD_KEYS and pod["restartPolicy"] == "Never" and rjob["template"]["spec"]["backoffLimit"] == 0
    [container] = pod["containers"]
    assert container["name"] == "node" and set(container) <= CONTAINER_KEYS
    assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}
    trainer = job["spec"]["trainer"]
    assert set(trainer) <= TRAINJOB_TRAINER_KEYS and all(isinstance(word, str) for word in trainer["command"])
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert all(isinstance(v, str) for v in env.values())
    policy = runtime["spec"]["mlPolicy"]
    assert int(env["NNODES"]) == trainer["numNodes"] == policy["numNodes"]
    assert int(env["GPUS_PER_NODE"]) == trainer["numProcPerNode"] == policy["torch"]["numProcPerNode"] == \
        trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]
    assert env["MASTER_ADDR"] == f"{name}-{rjob['name']}-0-0.{name}"  # the first pod, by JobSet's DNS names
    preempt = load_config(None, []).train.preempt_timeout_s
    assert int(env["PREEMPT_TIMEOUT_S"]) == preempt
    assert pod["terminationGracePeriodSeconds"] == preempt + EXIT_MARGIN_S
    jobset = _pod(_load("jobset.yaml"))["containers"][0]  # the same job as the JobSet's
    assert trainer["command"] == jobset["command"] and trainer["image"] == container["image"] == jobset["image"]
    assert trainer["env"] == jobset["env"]


def test_the_skypilot_task_holds_what_its_schema_requires():
    sky = _load("skypilot.yaml")
    assert set(sky) <= SKYPILOT_KEYS and sky["num_nodes"] >= 1 and isinstance(sky["run"], str)
    assert re.fullmatch(r"[\w-]+:\d+", sky["resources"]["accelerators"])
    assert "SKYPILOT_NODE_IPS" in sky["run"] and "SKYPILOT_NODE_RANK" in sky["run"]
    assert all(mount.get("mode") in ("MOUNT", "MOUNT_CACHED", "COPY") for mount in sky["file_mounts"].values())


def _recorder(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for the environment's python that records each call's arguments, one line per call."""
    calls, stub = tmp_path / "torchrun_calls", tmp_path / "python"
    stub.write_text('#!/usr/bin/env bash\n[ "$2" = pretrain.runtime.console_filter ] && exec cat  # the stderr filter\n'
                    f'echo "$*" >> {shlex.quote(str(calls))}\n')
    stub.chmod(0o755)
    return stub, calls


def _torchrun_lines(calls: Path) -> list[list[str]]:
    """Each recorded line with what differs by scheduler blanked (the first node's address, the run id)."""
    return sorted(re.sub(r"--(master-addr|rdzv-id)=\S+", r"--\1=*", line).split()
                  for line in calls.read_text().splitlines())


@pytest.mark.timeout(120)
def test_the_jobset_and_skypilot_commands_are_the_sbatch_scripts_torchrun_line(tmp_path):
    js, sky = _load("jobset.yaml"), _load("skypilot.yaml")
    container = _pod(js)["containers"][0]
    command = container["command"]
    assert command[0] == "tools/cluster/node.sh"
    config_args = command[1:]
    sky_run = sky["run"].strip().splitlines()
    assert sky_run[-1].startswith("exec tools/cluster/node.sh ")
    stub, calls = _recorder(tmp_path)
    base = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"} | {"PRETRAIN_PYTHON": str(stub)}
    clone = tmp_path / "clone"  # where each scheduler starts: the checkout
    clone.mkdir()
    (clone / "tools").symlink_to(ROOT / "tools")

    # SLURM: the batch script as the stub sbatch runs it (two nodes), config and overrides as the JobSet's
    slurm_dir = tmp_path / "slurm"
    slurm_dir.mkdir()
    (tmp_path / "bin").mkdir()  # the script's `uv sync` as a no-op: this checks the torchrun line (the extended test syncs)
    (tmp_path / "bin" / "uv").write_text("#!/usr/bin/env bash\n")
    (tmp_path / "bin" / "uv").chmod(0o755)
    env = base | {"PATH": os.pathsep.join([str(STUBS), str(tmp_path / "bin"), os.environ["PATH"]]),
                  "SLURM_STUB_DIR": str(slurm_dir)}
    subprocess.run([str(STUBS / "sbatch"), "--nodes=2", "--gpus-per-node=8", "tools/cluster/pretrain.sbatch",
                    *config_args], cwd=clone, env=env, check=True, capture_output=True, timeout=100)
    slurm = _torchrun_lines(calls)
    calls.unlink()

    # Kubernetes: each pod's command with its env and the Job's JOB_COMPLETION_INDEX
    pod_env = {e["name"]: e["value"] for e in container["env"]}
    for index in (0, 1):
        subprocess.run(command, cwd=clone, env=base | pod_env | {"JOB_COMPLETION_INDEX": str(index)}, check=True)
    assert _torchrun_lines(calls) == slurm
    calls.unlink()

    # Kubeflow Trainer: the TrainJob's command with its env, in each pod of the runtime's Indexed job
    trainer = _trainjob()[1]["spec"]["trainer"]
    for index in (0, 1):
        subprocess.run(trainer["command"], cwd=clone, check=True, env=base | {e["name"]: e["value"] for e in trainer["env"]}
                       | {"JOB_COMPLETION_INDEX": str(index)})
    assert _torchrun_lines(calls) == slurm
    calls.unlink()

    # SkyPilot: the run script on each node, with SkyPilot's variables; its config args as the JobSet's
    run = sky["run"].replace(shlex.join(shlex.split(sky_run[-1])[2:]), shlex.join(config_args))
    for rank in (0, 1):
        subprocess.run(["bash", "-c", run], cwd=clone, check=True, env=base | {
            "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8", "SKYPILOT_TASK_ID": "sky-managed-1"})
    assert _torchrun_lines(calls) == slurm
    assert [line[line.index("train") - 2:][:6] for line in slurm] == [
        ["-m", "pretrain", "train", *config_args[:1], "--set", "checkpoint.resume=true"]] * 2
    assert sorted(next(w for w in line if w.startswith("--node-rank=")) for line in slurm) == [
        "--node-rank=0", "--node-rank=1"]


def test_node_sh_runs_certify_on_the_nodes_and_refuses_another_command(tmp_path):
    stub, calls = _recorder(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"} | {
        "PRETRAIN_PYTHON": str(stub), "NNODES": "2", "NODE_RANK": "1", "GPUS_PER_NODE": "4", "MASTER_ADDR": "node-a"}
    node = [str(FILES / "node.sh"), "my.toml", "--set", "parallel.tp=2"]
    subprocess.run(node, env=env | {"PRETRAIN_COMMAND": "certify"}, check=True)
    assert calls.read_text().split() == [
        "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--master-addr=node-a",
        "--master-port=29500", "--rdzv-id=none", "--shutdown-timeout=120", "-m", "pretrain", "certify", "my.toml",
        "--set", "parallel.tp=2"]  # no resume: certify owns its --out
    res = subprocess.run(node, env=env | {"PRETRAIN_COMMAND": "trian"}, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr == "error: PRETRAIN_COMMAND=trian is not train or certify\n"
