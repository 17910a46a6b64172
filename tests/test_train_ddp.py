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
import stat
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
    lr_factor,
    parse_args,
    run,
    save_checkpoint,
    share_initial_weights,
)
from course_lib.train_ddp import training as recipe_training

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


def _recording_rank_losses() -> list[float]:
    """Record what each epoch's loss was on THIS rank before the average over ranks."""
    seen: list[float] = []
    average = recipe_training.reduce_value

    def recording(value, *args, **kwargs):
        seen.append(float(value))
        return average(value, *args, **kwargs)

    recipe_training.reduce_value = recording
    return seen


def batchnorm_evaluation(n: int = 101) -> dict:
    """Worker: a BatchNorm model whose running statistics differ on every rank (as after the
    last step of DDP training), evaluated by evaluate_exact and evaluate_padded.

    Returns rank 0's state dict as it was before the evaluation, the results, and how many of
    this rank's strided shard the rank's OWN model gets right (what the old code summed).
    """
    rank = dist.get_rank()
    torch.manual_seed(0)                                   # the same weights on every rank
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Linear(32, 10))
    g = torch.Generator().manual_seed(1)
    X = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)

    @torch.no_grad()
    def statistics_of(r: int) -> None:                     # as if rank r's last batches
        bn = model[2]
        bn.running_mean.copy_(torch.randn(32, generator=torch.Generator().manual_seed(r)) * 3)
        bn.running_var.fill_(0.25 + 2 * r)
        bn.num_batches_tracked.fill_(10 + r)

    statistics_of(0)
    with torch.no_grad():                                  # labels: rank 0's model gets 2/3
        y = model.eval()(X.float() / 255).argmax(dim=1)
    wrong = torch.rand(n, generator=g) < 1 / 3
    y[wrong] = (y[wrong] + 1) % 10
    statistics_of(rank)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    k = dist.get_world_size()
    model.eval()
    with torch.no_grad():
        own = int((model(X[rank::k].float() / 255).argmax(1) == y[rank::k]).sum())
    model.train()
    exact = evaluate_exact(model, X, y, 16, torch.device("cpu"))
    padded = evaluate_padded(model, X, y, 16, torch.device("cpu"))
    return {"state": state, "exact": tuple(exact), "padded": tuple(padded), "own": own,
            "training_after": model.training, "X": X, "y": y}


def several_runs(folder: str, weights: str) -> dict:
    """Worker: the runs every test below looks at, in one process group."""
    ck = {name: os.path.join(folder, f"{name}.pt") for name in "abcdewsr"}
    rank_losses = _recording_rank_losses()

    def recipe(argv: list[str]) -> dict:
        rank_losses.clear()
        summary = run(argv)
        summary["rank_losses"] = list(rank_losses)
        return summary

    out = {"reference": recipe(SMALL + ["--checkpoint", ck["a"],
                                        "--logdir", folder + "_tb"])}  # beside the folder
    out["stopped"] = recipe(SMALL + ["--checkpoint", ck["b"], "--stop-after", "1"])
    out["stopped_files"] = sorted(os.listdir(folder))
    if dist.get_rank() == 0:  # what a kill during a save leaves: removed at the next start
        with open(os.path.join(folder, "b.pt.k1ll3d.tmp"), "wb") as f:
            f.write(b"half a checkpoint")
    dist.barrier()
    out["resumed"] = recipe(SMALL + ["--checkpoint", ck["b"], "--resume"])
    out["resumed_files"] = sorted(os.listdir(folder))
    out["course"] = recipe(SMALL + ["--checkpoint", ck["c"], "--ddp", "course"])
    out["bf16"] = recipe(SMALL + ["--checkpoint", ck["d"], "--ddp", "course", "--comm-hook",
                                  "bf16"])
    out["bf16_torch"] = recipe(SMALL + ["--checkpoint", ck["e"], "--comm-hook", "bf16"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out["weights"] = recipe(SMALL + ["--checkpoint", ck["w"], "--weights", weights,
                                         "--freeze", "--epochs", "1"])
    out["weights_printed"] = printed.getvalue()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out["sync_bn"] = recipe(["--model", "resnet18", "--sync-bn", "--ddp", "course",
                                 "--epochs", "1", "--batch-size", "16", "--train-samples",
                                 "64", "--test-samples", "33", "--checkpoint", ck["r"]])
    out["sync_bn_printed"] = printed.getvalue()
    out["strided"] = recipe(SMALL + ["--sharding", "strided", "--epochs", "1",
                                     "--train-samples", "511", "--checkpoint", ck["s"]])
    out["init_file"] = _same_initial_weights_through_a_file(folder)
    out["eval"] = _evaluations(ck["a"])
    out["batchnorm"] = batchnorm_evaluation()
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
    results = launch(several_runs, 2, str(folder), weights, timeout=900)  # generous: a busy CPU
    return folder, results


def _one_process_correct(checkpoint: str, model: nn.Module, n: int) -> torch.Tensor:
    """Per example of the first ``n`` test images: does the checkpoint's model, in ONE
    process, on the whole slice, get it right? The oracle of every accuracy below."""
    from course_lib.data import load_fashion_mnist

    model.load_state_dict(load_checkpoint(checkpoint)["model"])
    model.eval()
    _, test_iter = load_fashion_mnist(256, quick=False)
    X, y = test_iter.X[:n].float() / 255, test_iter.y[:n]              # (n, 1, 28, 28), (n,)
    with torch.no_grad():
        return model(X).argmax(dim=1) == y                              # (n,)


def _assert_loss_is_the_mean_over_ranks(results: list, name: str) -> None:
    """Each epoch's reported loss is the mean of the ranks' own losses, which differ."""
    for epoch in range(len(results[0][name]["losses"])):
        own = [r[name]["rank_losses"][epoch] for r in results]
        assert own[0] != own[1], "both ranks saw the same data"
        for r in results:
            assert r[name]["losses"][epoch] == pytest.approx(sum(own) / len(own), rel=1e-6)


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
    assert len(r0["losses"]) == 2
    _assert_loss_is_the_mean_over_ranks(results, "reference")
    folder, _ = runs
    correct = _one_process_correct(str(folder / "a.pt"), LeNet(), 1001)
    assert r0["test_accuracy"] == r1["test_accuracy"] == int(correct.sum()) / 1001


def test_tensorboard_logs_the_lr_of_every_step_so_the_warmup_shows(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, _ = runs
    events = EventAccumulator(f"{folder}_tb")
    events.Reload()
    lr = [(e.step, e.value) for e in events.Scalars("train/lr")]
    accuracy = [e.step for e in events.Scalars("test/accuracy")]
    steps = 512 // 2 // 32                                      # 8 steps per epoch, 2 epochs
    expected = [0.1 * lr_factor(s, total_steps=2 * steps, warmup_steps=steps, start=0.5,
                                floor=0.05) for s in range(2 * steps)]
    assert [s for s, _ in lr] == list(range(1, 2 * steps + 1)) and accuracy == [1, 2]
    assert max(abs(v - e) for (_, v), e in zip(lr, expected)) < 1e-7
    assert lr[0][1] < lr[steps - 1][1] < lr[steps][1] == max(v for _, v in lr)  # the warm-up


def test_stop_and_resume_is_bitwise_equal(runs):
    folder, results = runs
    assert results[0]["stopped"]["stopped_after"] == 1
    assert results[0]["stopped_files"] == ["a.pt", "b.pt", "donor.pt"]  # no temporary left
    assert results[0]["resumed"]["resumed_from"] == 1
    assert "b.pt.k1ll3d.tmp" not in results[0]["resumed_files"]  # cleaned at the next start
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


def _uninterrupted(checkpoint: str) -> None:
    """Worker: the small recipe from start to end, its checkpoint at ``checkpoint``."""
    run(SMALL + ["--checkpoint", checkpoint])


@pytest.mark.slow
def test_killed_worker_is_restarted_by_torchrun_and_resumes(tmp_path, tmp_path_factory):
    # its own uninterrupted run (the `runs` fixture's "a.pt" is the same recipe): the slow tier
    # does not rebuild that whole fixture for one file
    reference = str(tmp_path_factory.mktemp("uninterrupted") / "a.pt")
    launch(_uninterrupted, 2, reference, timeout=600)
    ck = tmp_path / "k.pt"
    # --standalone: c10d rendezvous on a port torchrun binds itself (port 0), not one picked
    # free a moment before (find_free_port) that another process may take while torchrun
    # starts; --local-addr: the workers' MASTER_ADDR is the loopback, not the host name, which
    # a CI machine may resolve slowly, or to an address that is not this one, through DNS.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--local-addr=127.0.0.1", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "course_lib.train_ddp", *SMALL, "--checkpoint", str(ck), "--resume",
           "--kill-rank-at", "2:3"]
    # torch's rendezvous store, shared with the workers by default, keeps the killed group's
    # addresses and the restarted group reads them (pytorch/pytorch#135712): not shared, then.
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    output = run_commands([cmd], timeout=300, env=env, echo=False)[0]
    assert "rank 1 kills itself at epoch 2 step 3" in output
    assert "resuming from" in output and "1 epoch(s) done" in output
    _assert_same_state(load_checkpoint(reference), load_checkpoint(str(ck)))
    assert sorted(os.listdir(tmp_path)) == ["k.pt"]


@pytest.mark.slow
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
    folder, results = runs
    _assert_loss_is_the_mean_over_ranks(results, "strided")      # disjoint shards
    correct = _one_process_correct(str(folder / "s.pt"), LeNet(), 1001)
    assert results[0]["strided"]["test_accuracy"] == int(correct.sum()) / 1001


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
    _assert_loss_is_the_mean_over_ranks(results, "sync_bn")
    from course_lib.models.resnet import resnet18

    folder, _ = runs
    correct = _one_process_correct(str(folder / "r.pt"), resnet18(num_classes=10,
                                                                   in_channels=1), 33)
    for r in results:  # rank 0's saved model (its running statistics), on every rank
        assert r["sync_bn"]["test_accuracy"] == int(correct.sum()) / 33


# ------------------------------------------------------------------------------------------------
# Evaluation, initial weights, partial weights
# ------------------------------------------------------------------------------------------------

def test_exact_evaluation_counts_every_example_once(runs):
    folder, results = runs
    right = _one_process_correct(str(folder / "a.pt"), LeNet(), 1001)  # the oracle
    for rank in range(2):
        exact, padded = results[rank]["eval"]["exact"], results[rank]["eval"]["padded"]
        assert exact == (int(right.sum()), 1001)
        # DistributedSampler repeats example 0 to get 2 x 501: counted twice, right or wrong
        assert padded == (int(right.sum()) + int(right[0]), 1002)


def test_evaluation_scores_rank0s_model_whatever_each_ranks_batchnorm_statistics(runs):
    _, results = runs
    assert_rank0s_model_is_evaluated([r["batchnorm"] for r in results])


def assert_rank0s_model_is_evaluated(ranks: list[dict]) -> None:
    """evaluate_exact / evaluate_padded on k ranks whose BatchNorm running statistics differ
    equal rank 0's model evaluated in one process on the whole set (also used with 3 ranks)."""
    first = ranks[0]
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Linear(32, 10))
    model.load_state_dict(first["state"])
    model.eval()
    X, y = first["X"], first["y"]
    with torch.no_grad():
        right = model(X.float() / 255).argmax(dim=1) == y              # (n,)
    n, k = len(y), len(ranks)
    mixed = sum(r["own"] for r in ranks)  # each rank's shard scored by its own statistics
    assert mixed != int(right.sum()), "the statistics were not different enough to tell"
    repeated = int(right[: k * -(-n // k) - n].sum())                  # padding: the first ones
    for r in ranks:
        assert r["exact"] == (int(right.sum()), n)
        assert r["padded"] == (int(right.sum()) + repeated, k * -(-n // k))
        assert r["training_after"] is True                             # mode restored


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


def test_save_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    """The file's fsync makes its bytes durable, not its name: the folder's fsync must follow
    the rename, or a power cut can leave the old checkpoint (or none)."""
    path = str(tmp_path / "ck.pt")
    calls = []
    real_fsync = os.fsync

    def spy(fd):
        calls.append((stat.S_ISDIR(os.fstat(fd).st_mode), os.path.exists(path)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    save_checkpoint({"epoch": 1}, path)
    assert calls[0] == (False, False)           # the temporary file, before the rename
    assert calls[-1] == (True, True)            # the folder, after it


def test_damaged_empty_or_foreign_checkpoints_say_what_they_are(tmp_path):
    from course_lib.distributed import DistInfo
    from course_lib.train_ddp import restore

    good = str(tmp_path / "good.pt")
    save_checkpoint({"epoch": 1, "w": torch.ones(1000)}, good)
    data = open(good, "rb").read()
    cases = {"cut.pt": data[: len(data) // 2], "garbage.pt": b"not a checkpoint\n" * 50}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match="is damaged") as err:
            load_checkpoint(str(tmp_path / name))
        assert "weights_only" not in str(err.value), str(err.value)   # no unsafe advice
        assert "--checkpoint of an earlier run" in str(err.value)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is empty \(0 bytes\)"):
        load_checkpoint(str(tmp_path / "empty.pt"))
    plain = str(tmp_path / "plain.pt")
    torch.save(LeNet().state_dict(), plain)
    args = parse_args(SMALL + ["--checkpoint", plain, "--resume"])
    info = DistInfo(0, 1, 0, "gloo", torch.device("cpu"), "none")
    with pytest.raises(ValueError, match="plain state dict.*--weights"):
        restore(load_checkpoint(plain), None, None, None, args, info)
    torch.save({"model": LeNet().state_dict(), "epoch": 3}, plain)
    with pytest.raises(ValueError, match=r"lacks \['optimizer'"):
        restore(load_checkpoint(plain), None, None, None, args, info)


def test_checkpoint_path_is_checked_before_training(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path, says in ((a_file / "ck.pt", "cannot write a file in"),
                       (tmp_path, "is a folder")):
        with pytest.raises(SystemExit):
            parse_args(["--checkpoint", str(path)])
        err = capsys.readouterr().err
        assert f"--checkpoint {path}" in err and says in err, err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(SystemExit):
            parse_args(["--checkpoint", str(locked / "ck.pt")])
        assert "cannot write a file in" in capsys.readouterr().err
    assert parse_args(["--checkpoint", str(tmp_path / "new" / "ck.pt")]).checkpoint
    assert sorted(os.listdir(tmp_path)) == ["a_file", "new"]     # the probe file is gone


@pytest.mark.parametrize("argv, says", [
    (["--train-samples", "-5"], "argument --train-samples: expected an integer >= 1, got -5"),
    (["--train-samples", "0"], "argument --train-samples: expected an integer >= 1, got 0"),
    (["--test-samples", "-5"], "argument --test-samples: expected an integer >= 1"),
    (["--test-samples", "0"], "argument --test-samples: expected an integer >= 1"),
    (["--stop-after", "0", "--checkpoint", "CK"], "argument --stop-after: expected an integer"),
    (["--stop-after", "3", "--epochs", "2", "--checkpoint", "CK"], "after the last epoch"),
    (["--nan-rank", "5", "--nan-at-step", "2"], "--nan-rank 5: rank out of range, this run "
                                                "has 1 rank(s)"),
    (["--nan-rank", "1"], "--nan-rank chooses the rank of --nan-at-step"),
    (["--kill-rank", "1", "--kill-rank-at", "1:2"], "--kill-rank 1: rank out of range"),
    (["--kill-rank-at", "0:3"], "argument --kill-rank-at: epochs and steps count from 1"),
    (["--weight-decay", "nan"], "argument --weight-decay: expected a finite number"),
    (["--weight-decay", "-1"], "argument --weight-decay: expected a finite number in [0, inf)"),
    (["--lr", "0"], "argument --lr: expected a finite number in (0, inf)"),
    (["--lr", "inf"], "argument --lr: expected a finite number"),
    (["--momentum", "1"], "argument --momentum: expected a finite number in [0, 1)"),
    (["--warmup-epochs", "-1"], "argument --warmup-epochs"),
    (["--lrf", "0"], "argument --lrf: expected a finite number in (0, 1]"),
    (["--timeout", "nan"], "argument --timeout"),
    (["--epochs", "0"], "argument --epochs: expected an integer >= 1, got 0"),
    (["--batch-size", "x"], "argument --batch-size: expected an integer, got 'x'"),
])
def test_every_flag_is_checked_when_parsed_naming_it(argv, says, capsys, tmp_path):
    argv = [str(tmp_path / "ck.pt") if a == "CK" else a for a in argv]
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]     # the line after the usage
    assert says in err, err
    if "weight-decay" in says:
        assert "learning rate" not in err and "--lr" not in err


def test_more_samples_than_the_set_holds_is_an_error():
    from course_lib.train_ddp import load_data

    with pytest.raises(ValueError, match="--test-samples 10001: the set has only 10000"):
        load_data(parse_args(["--test-samples", "10001"]))


def test_fitting_weights_keep_a_models_own_module_prefix(tmp_path):
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(3, 2)                  # keys "module.weight", ...

    torch.manual_seed(0)
    saved = Holder()
    torch.save(saved.state_dict(), tmp_path / "plain.pt")
    torch.save(nn.DataParallel(saved).state_dict(), tmp_path / "wrapped.pt")
    for name in ("plain.pt", "wrapped.pt"):
        model = Holder()
        loaded, skipped = load_fitting_weights(model, str(tmp_path / name))
        assert loaded == ["module.bias", "module.weight"] and skipped == [], name
        assert torch.equal(model.module.weight, saved.module.weight)


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
