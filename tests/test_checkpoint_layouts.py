"""Checkpoints across parallel layouts (lesson 13): torch's ``fully_shard`` and DCP.

A float64 MLP trained 3 SGD steps under ``fully_shard`` on 2 ranks, beside one process on the
whole batch, saved with ``torch.distributed.checkpoint``; then loaded on 3 ranks (DCP reshards)
and in one process with no group. The oracles: the one-process model (to rounding), the layout
``course_lib.deploy.shard_rows`` / ``reshard`` predicts (exactly: it is what the real ranks
hold), and the saved tensors themselves (a load must give them back bit for bit).
"""
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from course_lib import deploy
from course_lib.distributed import launch
from course_lib.examples import checkpoint_workers as W

F64 = dict(rtol=1e-12, atol=1e-14)


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_save_on_2_load_on_3_and_on_1(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = launch(W.train_and_save, 2, path, timeout=120)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    full = saved[0]["full"]
    assert saved[1]["full"] == {}                                  # gathered to rank 0 only
    for key, value in full.items():                                # training matched one process
        torch.testing.assert_close(value, saved[0]["one"][key], **F64)
    assert not _equal(full, W.build_mlp().state_dict())            # and it did train
    for r in saved:                                                # fully_shard's rows: chunk
        assert _equal(r["local"], {k: deploy.shard_rows(v, 2)[r["rank"]] for k, v in full.items()})
    loaded = launch(W.load_resharded, 3, path, timeout=120)
    want = deploy.reshard([r["local"] for r in saved], 3)
    assert any(v.shape[0] == 0 for v in want[2].values())          # a rank left with no rows
    assert any(len(torch.tensor_split(v, 3)[2]) != len(want[2][k])  # not an even split
               for k, v in full.items())
    for r in loaded:
        assert _equal(r["local"], want[r["rank"]])                 # resharded on load, exactly
        assert torch.equal(r["probe"], saved[0]["probe"])
    assert _equal(loaded[0]["full"], full)
    plain = W.build_mlp(seed=9)                                    # one process, no group
    state = {"model": plain.state_dict()}
    with warnings.catch_warnings():                                # "assuming ... single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state["model"])
    assert _equal(plain.state_dict(), full)
    with torch.no_grad():
        assert torch.equal(plain(W.probe_batch()), saved[0]["probe"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(path, tmp_path / "full.pt")
    assert _equal(torch.load(tmp_path / "full.pt", weights_only=True)["model"], full)


def test_zero1_consolidated_into_one_process_adam(tmp_path):
    """3 ranks of the course's ZeRO-1: the saved optimizer loads into a plain Adam whose state
    equals one process's (to rounding), every parameter's state present though no rank held all."""
    path = str(tmp_path / "zero1.pt")
    ranks = launch(W.zero1_save, 3, path, timeout=120)
    n_params = len(list(W.build_mlp().parameters()))
    assert all(0 < r["held"] < n_params for r in ranks)             # sharded: no rank holds all
    assert sum(r["held"] for r in ranks) == n_params
    ckpt = torch.load(path, weights_only=True)
    model = W.build_mlp(seed=9)
    model.load_state_dict(ckpt["model"])
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    adam.load_state_dict(ckpt["optimizer"])
    one = ranks[0]["one_optimizer"]["state"]
    assert sorted(adam.state_dict()["state"]) == sorted(one) == list(range(n_params))
    for i, s in adam.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(s[name], one[i][name], **F64)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, ranks[0]["one_model"][key], **F64)


def test_fsdp_adam_resume_on_3_ranks_and_back_on_2(tmp_path):
    """FSDP2 + Adam saved on 2 ranks through get_state_dict and DCP, resumed on 3 (and that
    3-rank layout saved again and resumed on 2): parameters and Adam's state equal the saved
    ones bit for bit, and the next step equals the uninterrupted run's to float64 rounding."""
    a, b = str(tmp_path / "on2"), str(tmp_path / "on3")
    saved = launch(W.adam_train_and_save, 2, a, timeout=120)
    on3 = launch(W.adam_resume, 3, a, 3, 12, 0.05, b, timeout=120)     # 2 -> 3, saves again
    on2 = launch(W.adam_resume, 2, b, timeout=120)                     # 3 -> 2
    model, optim = saved[0]["saved"]
    assert saved[1]["saved"] == ({}, {}) and set(optim["state"]) == set(model)
    assert all(int(state["step"]) == 3 for state in optim["state"].values())   # a snapshot
    assert not _equal(model, W.build_mlp().state_dict())
    for ranks, world in ((on3, 3), (on2, 2)):
        got_model, got_optim = ranks[0]["loaded"]
        assert _equal(got_model, model)                                # bit for bit
        assert optim["param_groups"] == got_optim["param_groups"]
        for name, state in optim["state"].items():
            assert list(state) == ["step", "exp_avg", "exp_avg_sq"]
            assert all(torch.equal(got_optim["state"][name][k], v) for k, v in state.items())
        for r in ranks:                                                # sharded on this world
            for name, (rows, moment_rows) in r["local_rows"].items():
                assert rows == moment_rows == len(deploy.shard_rows(model[name], world)[r["rank"]])
        for key, value in saved[0]["next"].items():                    # one more step
            torch.testing.assert_close(ranks[0]["next"][key], value, **F64)
            assert not torch.equal(value, model[key])                  # and it moved
    # the oracle: one process, a plain Adam given the saved state, takes the same step on the
    # whole batch; the wrong resume (model only, a fresh Adam) does not
    one = W.build_mlp(seed=9)
    names = [n for n, _ in one.named_parameters()]
    nexts = []
    for with_optimizer in (True, False):
        one.load_state_dict(model)
        adam = torch.optim.Adam(one.parameters(), lr=0.05)
        if with_optimizer:
            adam.load_state_dict({"state": {i: optim["state"][n] for i, n in enumerate(names)},
                                  "param_groups": [{**optim["param_groups"][0],
                                                    "params": list(range(len(names)))}]})
        X, y = W.resume_batch(3, 12)
        torch.nn.functional.mse_loss(one(X), y).backward()
        adam.step()
        nexts.append({k: v.detach().clone() for k, v in one.state_dict().items()})
    for key, value in saved[0]["next"].items():
        torch.testing.assert_close(nexts[0][key], value, **F64)
    assert max((nexts[1][k] - v).abs().max().item() for k, v in saved[0]["next"].items()) > 1e-6
