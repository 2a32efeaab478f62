"""``[train].fault_tolerance = "replica"`` refuses up front, in one ``error:`` line and before any rank
starts, a layout in which a lost replica's state has no live copy (ZeRO over the whole dp, dp = 1, an
expert-parallel group spanning HSDP replicas) and launcher flags that name no node or no endpoint."""

import pytest
from typer.testing import CliRunner

from one_error_line import assert_one_error_line, snapshot
from pretrain.cli import app

runner = CliRunner()
SMALL = ["--set", "model.layers=2", "--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set",
         "train.eval_every=0", "--set", "log.progress=false", "--set", "train.fault_tolerance=replica"]

CASES = {
    "zero-3 over the whole dp": (["--nproc", "2", "--set", "parallel.zero=optim_grads_params"],
                                 "shards it over the whole dp"),
    "zero-1 over the whole dp": (["--nproc", "2", "--set", "parallel.zero=optim"],
                                 "or zero='optim', 'optim_grads' or 'optim_grads_params' with [train].buddy_shards=1"),
    "buddy shards under torch's fsdp2": (["--nproc", "2", "--set", "parallel.zero=torch_fsdp2", "--set", "train.buddy_shards=1"],
                                         "use [parallel].zero='optim_grads_params' (par's ZeRO-3) with buddy_shards=1, "
                                         "or hsdp_replicas >= 2"),
    "zero-3 buddy shards with experts": (["--nproc", "2", "tiny-moe", "--set", "parallel.zero=optim_grads_params", "--set",
                                          "train.buddy_shards=1"], "got [model].num_experts="),
    "buddy shards with muon under zero-3": (["--nproc", "2", "--set", "parallel.zero=optim_grads_params", "--set",
                                             "train.buddy_shards=1", "--set", "train.optimizer=muon"],
                                            "with [train].optimizer='muon' runs with [parallel].zero='optim' or 'optim_grads'"),
    "buddy shards with muon and experts": (["--nproc", "4", "tiny-moe", "--set", "parallel.ep=2", "--set", "parallel.zero=optim",
                                            "--set", "train.buddy_shards=1", "--set", "train.optimizer=muon"],
                                           "got zero='optim', ep=2"),
    "buddy shards with muon at tp 2": (["--nproc", "4", "--set", "parallel.tp=2", "--set", "parallel.zero=optim", "--set",
                                       "train.buddy_shards=1", "--set", "train.optimizer=muon"],
                                      "under fault_tolerance='replica' runs at tp=1 so far (got [parallel].tp=2)"),
    "buddy shards = 2": (["--nproc", "2", "--set", "parallel.zero=optim", "--set", "train.buddy_shards=2"],
                         "[train].buddy_shards=2 is not one of 0, 1"),
    "dp = 1": (["--nproc", "1"], "needs dp >= 2 (got dp=1)"),
    "dp = 1 under tp": (["--nproc", "2", "--set", "parallel.tp=2"], "needs dp >= 2 (got dp=1)"),
    "one replica: dp = ep": (["--nproc", "2", "tiny-moe", "--set", "parallel.ep=2"],
                             "needs two replicas, but dp=2 is one expert-parallel group ([parallel].ep=2)"),
    "dynamic cp, a window past one replica's ranks": (["--nproc", "4", "--set", "parallel.cp=2", "--set", "parallel.dynamic_cp=true",
                                                      "--set", "parallel.max_seq_per_rank=16", "--set", "data.document_mask=true"],
                                                     "to fit the 2 dp x cp ranks of one replica"),
    "an ep group spanning hsdp replicas": (["--nproc", "4", "tiny-moe", "--set", "parallel.ep=4", "--set",
                                            "parallel.zero=optim_grads_params", "--set", "parallel.hsdp_replicas=2"],
                                           "ranks [0, 1, 2, 3] span replicas"),
    "ep outside dp": (["tiny-moe", "--nproc", "4", "--set", "parallel.ep=2", "--set", "parallel.order=tp-cp-dp-ep-pp"],
                      "ranks [0, 2] span replicas under order 'tp-cp-dp-ep-pp'"),
    "cp outside dp, buddies": (["--nproc", "4", "--set", "parallel.cp=2", "--set", "parallel.zero=optim", "--set",
                                "train.buddy_shards=1", "--set", "parallel.order=tp-dp-cp-ep-pp"],
                               "under order 'tp-dp-cp-ep-pp' rank 0's lies in its own replica"),
    "--nnodes without an endpoint": (["--nproc", "1", "--nnodes", "2", "--node-rank", "1"], "--rdzv-endpoint None must be HOST:PORT"),
    "an endpoint without a port": (["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0' must be"),
    "--node-rank past --nnodes": (["--nproc", "1", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"],
                                  "--node-rank 2 must be in 0..1"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_layout_without_a_live_copy_is_one_error_line(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    args, words = CASES[name]
    res = runner.invoke(app, ["train", *SMALL, *args, "--set", "log.dir=run"])
    assert_one_error_line(res, name, words)
    assert snapshot(tmp_path) == {}, name
