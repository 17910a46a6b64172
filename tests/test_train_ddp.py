"""``python -m course_lib.train_ddp``: resume, checkpoints, evaluation and failures, on gloo.

Several short runs (2 ranks, LeNet, 512 training examples, 8 steps per epoch) share one
``launch`` (the workers import torch and torchvision once); each test then checks one claim:
a run stopped and resumed ends bitwise equal to an uninterrupted one, torchrun's restart after a
killed worker too, the course's DDP gives torch's weights, evaluation counts every test example
once, ``--weights`` loads what fits, a nan stops every rank, a crash while saving keeps the
previous checkpoint.
"""
import contextlib
import importlib.util
import io
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import find_free_port, launch, run_commands
from course_lib.models.lenet import LeNet
from course_lib.train_ddp import (
    StridedShards,
    build_model,
    evaluate_exact,
    evaluate_padded,
    load_checkpoint,
    load_fitting_weights,
    parse_args,
    run,
    save_checkpoint,
    share_initial_weights,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model", "lenet", "--epochs", "2", "--batch-size", "32", "--train-samples", "512",
         "--test-samples", "1001", "--lr", "0.05", "--seed", "0"]
ENV = {"TQDM_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}


# ------------------------------------------------------------------------------------------------
# One launch, several runs (each a function the worker calls)
# ------------------------------------------------------------------------------------------------

def _same_initial_weights_through_a_file(folder: str) -> bool:
    """Different seeds per rank, then share_initial_weights: equal everywhere, file removed."""
    from course_lib.distributed import init_distributed_mode

    info = init_distributed_mode(verbose=False)
    model = build_model(parse_args(SMALL), info.device, info.rank)  # seeded seed + rank
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    before = [torch.empty_like(flat) for _ in range(info.world_size)]
    dist.all_gather(before, flat)
    share_initial_weights(model, info, folder)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    after = [torch.empty_like(flat) for _ in range(info.world_size)]
    dist.all_gather(after, flat)
    dist.barrier()
    left = [f for f in os.listdir(folder) if f.startswith("init_weights_")]
    return (not torch.equal(before[0], before[1]) and torch.equal(after[0], after[1])
            and torch.equal(after[0], before[0]) and not left)


def _evaluations(checkpoint: str) -> dict:
    """Exact and padded evaluation of a trained LeNet on 1001 test examples."""
    from course_lib.data import load_fashion_mnist

    model = LeNet()
    model.load_state_dict(load_checkpoint(checkpoint)["model"])
    _, test_iter = load_fashion_mnist(256, quick=False)
    X, y = test_iter.X[:1001], test_iter.y[:1001]
    return {"exact": evaluate_exact(model, X, y, 100, torch.device("cpu")),
            "padded": evaluate_padded(model, X, y, 100, torch.device("cpu"))}


def several_runs(folder: str, weights: str) -> dict:
    """Worker: the runs every test below looks at, in one process group."""
    ck = {name: os.path.join(folder, f"{name}.pt") for name in "abcdew"}
    out = {"reference": run(SMALL + ["--checkpoint", ck["a"]])}
    out["stopped"] = run(SMALL + ["--checkpoint", ck["b"], "--stop-after", "1"])
    out["stopped_files"] = sorted(os.listdir(folder))
    out["resumed"] = run(SMALL + ["--checkpoint", ck["b"], "--resume"])
    out["course"] = run(SMALL + ["--checkpoint", ck["c"], "--ddp", "course"])
    out["bf16"] = run(SMALL + ["--checkpoint", ck["d"], "--ddp", "course", "--comm-hook", "bf16"])
    out["bf16_torch"] = run(SMALL + ["--checkpoint", ck["e"], "--comm-hook", "bf16"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out["weights"] = run(SMALL + ["--checkpoint", ck["w"], "--weights", weights, "--freeze",
                                      "--epochs", "1"])
    out["weights_printed"] = printed.getvalue()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out["sync_bn"] = run(["--model", "resnet18", "--sync-bn", "--ddp", "course", "--epochs",
                              "1", "--batch-size", "16", "--train-samples", "64",
                              "--test-samples", "33"])
    out["sync_bn_printed"] = printed.getvalue()
    out["strided"] = run(SMALL + ["--sharding", "strided", "--epochs", "1", "--train-samples",
                                  "511"])
    out["init_file"] = _same_initial_weights_through_a_file(folder)
    out["eval"] = _evaluations(ck["a"])
    return out


def _head_of_another_shape(path: str) -> None:
    torch.manual_seed(123)
    donor = LeNet()
    donor.fc2 = nn.Linear(128, 5)  # another number of classes: must be skipped
    torch.save(donor.state_dict(), path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train_ddp")
    weights = str(folder / "donor.pt")
    _head_of_another_shape(weights)
    results = launch(several_runs, 2, str(folder), weights, timeout=400)
    return folder, results


def _assert_same_state(a: dict, b: dict) -> None:
    """Model and optimizer states bitwise equal."""
    assert a["epoch"] == b["epoch"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


# ------------------------------------------------------------------------------------------------
# Resume, restart, DDP implementations
# ------------------------------------------------------------------------------------------------

def test_summary_says_global_batch_and_rule(runs):
    _, results = runs
    r0, r1 = results[0]["reference"], results[1]["reference"]
    assert r0["global_batch"] == 64 and r0["world_size"] == 2
    assert "linear scaling rule" in r0["lr_rule"] and "0.05 x 2 = 0.1" in r0["lr_rule"]
    assert len(r0["losses"]) == 2 and r0["losses"] == r1["losses"]  # averaged over ranks
    assert 0 <= r0["test_accuracy"] <= 1


def test_stop_and_resume_is_bitwise_equal(runs):
    folder, results = runs
    assert results[0]["stopped"]["stopped_after"] == 1
    assert results[0]["stopped_files"] == ["a.pt", "b.pt", "donor.pt"]  # no temporary left
    assert results[0]["resumed"]["resumed_from"] == 1
    assert load_checkpoint(str(folder / "b.pt"))["epoch"] == 2
    _assert_same_state(load_checkpoint(str(folder / "a.pt")), load_checkpoint(str(folder / "b.pt")))
    assert results[0]["resumed"]["test_accuracy"] == results[0]["reference"]["test_accuracy"]


def test_course_ddp_gives_torch_ddp_weights(runs):
    folder, _ = runs
    ours, theirs = load_checkpoint(str(folder / "c.pt")), load_checkpoint(str(folder / "a.pt"))
    for k in theirs["model"]:
        torch.testing.assert_close(ours["model"][k], theirs["model"][k], rtol=1e-5, atol=1e-6)


def test_bf16_comm_hook_trains_close_to_float32_with_either_ddp(runs):
    folder, results = runs
    fp32 = load_checkpoint(str(folder / "a.pt"))["model"]
    for name in ("d", "e"):  # the course's DDP with its hook, torch's with torch's
        bf16 = load_checkpoint(str(folder / f"{name}.pt"))["model"]
        assert any(not torch.equal(bf16[k], fp32[k]) for k in fp32), "the hook changed nothing"
        for k in fp32:
            torch.testing.assert_close(bf16[k], fp32[k], rtol=0.1, atol=1e-2)  # 16 steps apart
    gap = results[0]["bf16"]["test_accuracy"] - results[0]["reference"]["test_accuracy"]
    assert abs(gap) < 0.05


def test_killed_worker_is_restarted_by_torchrun_and_resumes(runs, tmp_path):
    folder, _ = runs
    ck = tmp_path / "k.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:"
           f"{find_free_port()}", "-m", "course_lib.train_ddp", *SMALL, "--checkpoint", str(ck),
           "--resume", "--kill-rank-at", "2:3"]
    # torch's rendezvous store, shared with the workers by default, keeps the killed group's
    # addresses and the restarted group reads them (pytorch/pytorch#135712): not shared, then.
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    output = run_commands([cmd], timeout=180, env=env, echo=False)[0]
    assert "rank 1 kills itself at epoch 2 step 3" in output
    assert "resuming from" in output and "1 epoch(s) done" in output
    _assert_same_state(load_checkpoint(str(folder / "a.pt")), load_checkpoint(str(ck)))
    assert sorted(os.listdir(tmp_path)) == ["k.pt"]


def test_nonfinite_loss_stops_every_rank_with_the_step_and_lr(tmp_path):
    port = find_free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, **ENV, "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "course_lib.train_ddp", *SMALL, "--nan-at-step", "3",
             "--nan-rank", "1", "--init-from-rank0-file", "--checkpoint",
             str(tmp_path / "n.pt")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 1, f"rank {rank} exited with {p.returncode}:\n{text}"
        assert "not finite" in text and "rank(s) [1]" in text, text
        assert "global step 3" in text and "learning rate" in text, text
        assert "Traceback" not in text, text
    assert os.listdir(tmp_path) == []  # no initial-weights file, no checkpoint (epoch 1 unfinished)


def test_strided_sharding_trains_without_a_dataloader(runs):
    _, results = runs
    assert results[0]["strided"]["losses"] == results[1]["strided"]["losses"]
    assert 0 <= results[0]["strided"]["test_accuracy"] <= 1


def test_strided_shards_are_disjoint_equal_and_reshuffled_each_epoch():
    X, y = torch.arange(11).reshape(11, 1, 1, 1), torch.arange(11)
    shards = [StridedShards(X, y, 2, rank, 3, seed=0) for rank in range(3)]
    orders = []
    for epoch in (1, 2):
        for s in shards:
            s.set_epoch(epoch)
        seen = [torch.cat([yb for _, yb in s]) for s in shards]
        assert [len(t) for t in seen] == [3, 3, 3]  # 11 // 3 each: the last 11 % 3 dropped
        assert len(set(torch.cat(seen).tolist())) == 9  # disjoint
        assert len(shards[0]) == 2  # batches of 2, 1
        orders.append(torch.cat(seen).tolist())
    assert orders[0] != orders[1]


def test_sync_bn_resnet18_trains_with_the_course_ddp(runs):
    _, results = runs
    assert "--sync-bn: 17 BatchNorm layer(s) now normalise over the global batch" in \
        results[0]["sync_bn_printed"]
    assert results[0]["sync_bn"]["losses"] == results[1]["sync_bn"]["losses"]
    assert 0 <= results[0]["sync_bn"]["test_accuracy"] <= 1


# ------------------------------------------------------------------------------------------------
# Evaluation, initial weights, partial weights
# ------------------------------------------------------------------------------------------------

def test_exact_evaluation_counts_every_example_once(runs):
    folder, results = runs
    model = LeNet()
    model.load_state_dict(load_checkpoint(str(folder / "a.pt"))["model"])
    model.eval()
    from course_lib.data import load_fashion_mnist

    _, test_iter = load_fashion_mnist(256, quick=False)
    X, y = test_iter.X[:1001].float() / 255, test_iter.y[:1001]
    with torch.no_grad():
        correct = int((model(X).argmax(dim=1) == y).sum())  # one process, the whole set
    for rank in range(2):
        exact, padded = results[rank]["eval"]["exact"], results[rank]["eval"]["padded"]
        assert exact == (correct, 1001)
        assert padded.count == 1002  # DistributedSampler repeats one example to get 2 x 501
        assert padded.accuracy != exact.accuracy


def test_initial_weights_through_a_file_are_rank0s(runs):
    _, results = runs
    assert results[0]["init_file"] and results[1]["init_file"]


def test_weights_load_what_fits_and_name_what_is_skipped(tmp_path, capsys):
    path = str(tmp_path / "donor.pt")
    _head_of_another_shape(path)
    donor = torch.load(path)
    model = build_model(parse_args(SMALL + ["--weights", path]), torch.device("cpu"))
    printed = capsys.readouterr().out
    assert "loaded 6 tensor(s); skipped 2" in printed
    assert "skipped fc2.weight: file (5, 128), model (10, 128)" in printed
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, donor[name]) == (not name.startswith("fc2.")), name
    loaded, skipped = load_fitting_weights(LeNet(), path)
    assert loaded == sorted(k for k in donor if not k.startswith("fc2."))


def test_freeze_trains_only_the_head_after_partial_weights(runs):
    folder, results = runs
    assert "skipped fc2.bias: file (5,), model (10,)" in results[0]["weights_printed"]
    assert results[1]["weights_printed"].count("skipped") == 0  # printed by rank 0 only
    donor, trained = torch.load(str(folder / "donor.pt")), load_checkpoint(str(folder / "w.pt"))
    for name, tensor in trained["model"].items():
        frozen = not name.startswith("fc2.")
        assert torch.equal(tensor, donor[name]) if frozen else tensor.shape[0] == 10, name


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------

def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.pt")
    save_checkpoint({"epoch": 1, "w": torch.ones(3)}, path)

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint({"epoch": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    state = load_checkpoint(path)
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert os.listdir(tmp_path) == ["ck.pt"]  # the temporary file is gone


def test_bad_options_say_what_to_do(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        parse_args(["--stop-after", "1"])
    assert "need --checkpoint PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--kill-rank-at", "two"])
    assert "expected EPOCH:STEP" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="leave out --resume"):
        load_checkpoint("/nonexistent/ck.pt")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(SystemExit):
        parse_args(["--logdir", "runs"])
    assert "--logdir needs the tensorboard package" in capsys.readouterr().err
