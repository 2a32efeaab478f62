"""`pretrain cluster FILE CONFIG`: the shipped launch files (tools/cluster/) checked against a config before the
job waits in the queue: nodes x GPUs against the layout, tp within a node, the SIGTERM-to-kill grace against
[train].preempt_timeout_s. In process (CliRunner), no rank started."""

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from one_error_line import assert_one_error_line, snapshot
from pretrain.cli import app

ROOT = Path(__file__).resolve().parents[3]
FILES = ROOT / "tools" / "cluster"
FITS = ["--set", "train.global_batch=16"]  # tiny's batch of 8 at dp 16 (2 nodes x 8 GPUs)


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.mark.parametrize("name, grace", [("pretrain.sbatch", "--signal=B:TERM@180: 180 s"),
                                         ("jobset.yaml", "terminationGracePeriodSeconds: 180: 180 s"),
                                         ("trainjob.yaml", "terminationGracePeriodSeconds: 180: 180 s"),
                                         ("skypilot.yaml", "spot VMs are reclaimed without a grace")])
def test_each_shipped_file_fits_a_config_for_its_2_nodes_x_8_gpus(runner, name, grace):
    res = runner.invoke(app, ["cluster", str(FILES / name), *FITS, "--set", "parallel.tp=8", "--set",
                              "checkpoint.every=100"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"fits: {FILES / name}: 2 nodes x 8 GPUs = 16 ranks: tp=8 cp=1 pp=1 dp=2, each tp "
                                 f"group within a node; {grace}"), res.output


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The shipped files, and copies each with one mistake a user makes."""
    d = tmp_path_factory.mktemp("files")
    for f in FILES.iterdir():
        shutil.copy(f, d / f.name)
    sbatch = (FILES / "pretrain.sbatch").read_text()
    (d / "short.sbatch").write_text(sbatch.replace("--signal=B:TERM@180", "--signal=B:TERM@60"))
    (d / "nosignal.sbatch").write_text(sbatch.replace("#SBATCH --signal=B:TERM@180\n", ""))
    jobset = (FILES / "jobset.yaml").read_text()
    (d / "grace30.yaml").write_text(jobset.replace("terminationGracePeriodSeconds: 180", "terminationGracePeriodSeconds: 30"))
    (d / "nograce.yaml").write_text(jobset.replace("terminationGracePeriodSeconds: 180", ""))
    (d / "nojobs.yaml").write_text("apiVersion: jobset.x-k8s.io/v1alpha2\nkind: JobSet\nspec: {}\n")
    trainjob = (FILES / "trainjob.yaml").read_text()
    (d / "trainjob30.yaml").write_text(trainjob.replace("terminationGracePeriodSeconds: 180",
                                                        "terminationGracePeriodSeconds: 30"))
    (d / "trainjob_alone.yaml").write_text(trainjob.split("\n---\n", 1)[1])
    (d / "broken.yaml").write_text("kind: JobSet\nspec: [unclosed\n")
    (d / "notes.txt").write_text("nothing to launch\n")
    return d


CASES = {  # name: (file, extra args, words the one line holds)
    "world does not fit the batch": ("pretrain.sbatch", [], "2 nodes x 8 GPUs = 16 ranks: [train].global_batch=8 is not "
                                                            "divisible by dp=16"),
    "nodes from sbatch's command line": ("pretrain.sbatch", ["--nodes", "3", "--gpus-per-node", "2"],
                                         "3 nodes x 2 GPUs = 6 ranks"),
    "tp wider than a node": ("jobset.yaml", [*FITS, "--gpus-per-node", "4", "--nodes", "4", "--set", "parallel.tp=8"],
                             "[parallel].tp=8 does not fit within a node of 4 GPUs"),
    "tp across nodes under the order": ("pretrain.sbatch", [*FITS, "--set", "parallel.tp=2", "--set",
                                                            "parallel.order=dp-tp-cp-ep-pp", "--set",
                                                            "parallel.rank_assignment=off"],
                                        "with [parallel].order='dp-tp-cp-ep-pp' the tp group of ranks [0, 8] spans nodes"),
    "grace shorter than the save": ("short.sbatch", FITS, "--signal=B:TERM@60 gives the ranks 60 s from SIGTERM to the "
                                                          "kill, less than [train].preempt_timeout_s=120 s + 60 s"),
    "Kubernetes' default grace": ("grace30.yaml", FITS, "terminationGracePeriodSeconds: 30 gives the ranks 30 s"),
    "Kubernetes' grace left out": ("nograce.yaml", FITS, "no terminationGracePeriodSeconds: Kubernetes' default 30 s"),
    "a TrainingRuntime's default grace": ("trainjob30.yaml", FITS, "terminationGracePeriodSeconds: 30 gives the ranks 30 s"),
    "a TrainJob without its runtime": ("trainjob_alone.yaml", FITS, "no TrainingRuntime beside the TrainJob"),
    "a JobSet without jobs": ("nojobs.yaml", FITS, "nojobs.yaml: spec.replicatedJobs is missing"),
    "a longer preempt_timeout_s": ("jobset.yaml", [*FITS, "--set", "train.preempt_timeout_s=600"],
                                   "give at least 660 s"),
    "no --signal": ("nosignal.sbatch", FITS, "#SBATCH --signal= does not send SIGTERM before the time limit"),
    "spot without periodic saves": ("skypilot.yaml", FITS, "[checkpoint].every=0 saves only at the end"),
    "YAML that does not parse": ("broken.yaml", [], "broken.yaml is not valid YAML"),
    "not a launch file": ("notes.txt", [], "has no #SBATCH line and is not a .yaml file"),
    "missing file": ("absent.sbatch", [], "cannot read launch file"),
    "zero nodes": ("pretrain.sbatch", ["--nodes", "0"], "--nodes 0 must be >= 1"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_file_that_does_not_fit_is_one_error_line_before_the_queue(runner, files, name):
    file, extra, words = CASES[name]
    before = snapshot(files)
    res = runner.invoke(app, ["cluster", str(files / file), *extra])
    assert_one_error_line(res, name, words)
    assert snapshot(files) == before
