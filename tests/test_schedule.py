"""The rate's schedules (train.schedule): the plateau rule on scripted validation curves, its stops, resume in
the middle of a plateau, and SpecAugment's per-utterance masks."""
import json
from types import SimpleNamespace

import pytest
import torch

from batchrnn.config import ConfigError
from batchrnn.training.augment import SpecAugment
from batchrnn.training.loop import Progress, train
from batchrnn.training.rundir import RESULTS
from batchrnn.validation import validate
from conftest import killed_after

PLATEAU = dict(schedule="plateau", plateau_wait=1, plateau_factor=0.5, plateau_min_cuts=1, plateau_floor=0.1,
               plateau_hold_blank=True, patience=3, patience_loss_drop=0.02, warmup_steps=0, epochs=100, lr_gamma=0.9)


def walk(curve, **settings):
    """Feeds (val WER, val loss) epoch by epoch; returns per epoch (the next epoch's rate scale, the stop)."""
    t = SimpleNamespace(**(PLATEAU | settings))
    p, seen = Progress(), []
    for wer, loss in curve:
        p.epoch += 1
        p.step += 10
        p.judge(wer, loss, t)
        seen.append((p.lr_scale(t), p.stop(t)))
        if seen[-1][1]:
            break
    return seen


def test_the_rate_is_held_while_validation_improves_and_cut_when_it_stops():
    flat = 3.0  # the loss never falls: only WER counts
    seen = walk([(0.9, flat), (0.8, flat), (0.8, flat), (0.8, flat), (0.7, flat), (0.7, flat), (0.7, flat)])
    assert [s for s, _ in seen] == [1, 1, 0.5, 0.25, 0.25, 0.125, 0.0625]
    assert [stop for _, stop in seen] == [None] * 6 + ["floor"], "below plateau_floor x lr: the run ends"


def test_a_loss_fall_counts_as_improvement_as_patience_counts_it():
    seen = walk([(0.9, 3.0), (0.9, 2.5), (0.9, 2.0), (0.9, 1.99)], plateau_floor=1e-3)
    assert [s for s, _ in seen] == [1, 1, 1, 0.5]  # 2% falls held the rate; 0.5% does not


def test_no_cut_while_the_network_has_not_got_a_word_right():
    """CTC's blank phase (validation WER 100%, the loss falling by less than patience_loss_drop an epoch): the rate
    is held until a word is right; a run that stays blank with its loss not falling is stopped by patience."""
    slow = [(1.0, 3.0), (1.0, 2.99), (1.0, 2.98), (1.0, 2.9), (0.95, 2.8), (0.95, 2.8)]
    assert [s for s, _ in walk(slow, plateau_floor=1e-3)] == [1, 1, 1, 1, 1, 0.5]
    assert [s for s, _ in walk(slow, plateau_floor=1e-3, plateau_hold_blank=False)][:3] == [1, 0.5, 0.25]
    stuck = walk([(1.0, 3.0)] * 10, plateau_floor=1e-3, patience=3)
    assert stuck[-1] == (1, "patience") and len(stuck) == 4


def test_patience_stops_a_plateau_run_only_after_its_minimum_cuts():
    curve = [(0.5, 1.0)] + [(0.6, 1.0)] * 10
    seen = walk(curve, plateau_wait=5, patience=2, plateau_floor=1e-3)
    # epoch 6: the first cut; epoch 7, trained at the cut rate: patience
    assert [stop for _, stop in seen] == [None] * 6 + ["patience"]
    assert seen[-1][0] == 0.5
    seen = walk(curve, plateau_wait=5, patience=2, plateau_floor=1e-3, plateau_min_cuts=0)
    assert [stop for _, stop in seen] == [None, None, "patience"]


def test_exponential_keeps_its_rule():
    seen = walk([(0.5, 1.0)] + [(0.6, 1.0)] * 10, schedule="exponential", patience=3)
    assert [round(s, 6) for s, _ in seen] == [0.9, 0.81, 0.729, 0.6561]
    assert seen[-1][1] == "patience"


def test_no_cut_during_warm_up():
    seen = walk([(0.5, 1.0), (0.6, 1.0), (0.6, 1.0)], warmup_steps=25, plateau_floor=1e-3)
    assert [s for s, _ in seen] == [1, 1, 0.5]  # steps 10, 20 are warm-up; step 30 is not


@pytest.mark.parametrize("override,message", [
    ("train.plateau_factor=1", "must be in \\(0, 1\\), or the rate never falls"),
    ("train.plateau_floor=0", "train.plateau_floor=0"),
    ("train.plateau_wait=0", "must be 1 or more epochs"),
    ("train.schedule=cosine", None),
])
def test_bad_plateau_settings_are_refused(make_config, override, message):
    if message is None:  # not a Schedule: Hydra refuses the override itself
        with pytest.raises(Exception, match="train.schedule=cosine"):
            make_config("experiment=smoke", override)
        return
    with pytest.raises(ConfigError, match=message):
        validate(make_config("experiment=smoke", override))


# cuts even if smoke gets no word right in 4 epochs
PLATEAU_RUN = ("train.schedule=plateau", "train.plateau_wait=1", "train.patience=0", "train.patience_loss_drop=0.9",
               "train.plateau_floor=1e-6", "train.plateau_hold_blank=false")


def test_resume_in_the_middle_of_a_plateau_is_the_uninterrupted_run(make_config, smoke_root, tmp_path):
    smoke = lambda *o: make_config("experiment=smoke", f"data.root={smoke_root}", *PLATEAU_RUN, *o)  # noqa: E731
    whole = train(smoke("train.epochs=4"), tmp_path / "whole")
    rates = [e["lr"] for e in whole["epochs"]]
    assert min(rates) < max(rates), f"the rate was never cut, so this proves nothing: {rates}"
    part = tmp_path / "part"
    with killed_after(2):
        train(smoke("train.epochs=4"), part)
    resumed = train(smoke("train.epochs=4"), part)
    for key in ("train_loss", "val_loss", "lr"):
        assert [e[key] for e in resumed["epochs"]] == pytest.approx([e[key] for e in whole["epochs"]]), key
    saved = json.loads((tmp_path / "whole" / RESULTS).read_text())
    assert saved["stop"] == "cap" and saved["lr_at_stop"] == pytest.approx(rates[-1] / saved["config"]["train"]["lr"])
    best = saved["epochs"][saved["best_epoch"] - 1]
    assert saved["train_loss_at_best"] == best["train_loss"]


def augment(per_utterance=True, seed=1, time_width=20):
    cfg = SimpleNamespace(freq_masks=2, freq_width=8, time_masks=2, time_width=time_width, per_utterance=per_utterance)
    return SpecAugment(cfg, seed)


def test_time_masks_are_refused_where_they_could_cover_a_typical_utterance_and_warned_of_for_the_shortest(caplog):
    augment().check([41, 50, 60])  # 2 masks of up to 20 frames reach 40: less than every utterance
    assert not caplog.records
    augment().check([30, 40, 50, 60, 70])
    (record,) = caplog.records
    assert record.getMessage() == ("train.spec_augment: 2 time masks of up to 20 frames could cover the 2 shortest "
                                   "of 5 training utterances (40 frames or fewer) whole")
    with pytest.raises(ConfigError, match=r"train.spec_augment.time_width=30: 2 masks of up to 30 frames could cover "
                                          r"the median training utterance \(60 frames\) whole"):
        augment(time_width=30).check([30, 40, 60, 61, 70])


def batch(*utterances):
    """Padded (N, F, T) of ones, their lengths and ids, from (id, length) pairs."""
    lengths = torch.tensor([n for _, n in utterances])
    x = torch.zeros(len(utterances), 40, int(lengths.max()))
    for k, n in enumerate(lengths.tolist()):
        x[k, :, :n] = 1
    return x, lengths, [u for u, _ in utterances]


def test_per_utterance_masks_do_not_depend_on_the_batch():
    a = ("an4/a", 50)
    x1 = augment()(*batch(a, ("an4/b", 80)), epoch=3)
    x2 = augment()(*batch(("an4/c", 120), a), epoch=3)
    assert torch.equal(x1[0, :, :50], x2[1, :, :50])
    assert (x1[0, :, :50] == 0).any(), "some of it is masked"
    assert (x1[0, :, 50:] == 0).all() and (x2[1, :, 50:] == 0).all(), "padding stays padding"
    other_epoch = augment()(*batch(a), epoch=4)
    other_seed = augment(seed=2)(*batch(a), epoch=3)
    assert not torch.equal(other_epoch[0], x1[0, :, :50]) and not torch.equal(other_seed[0], x1[0, :, :50])


def test_batch_masks_are_torchaudios_stream_as_before():
    x, lengths, ids = batch(("an4/a", 50), ("an4/b", 80))
    torch.manual_seed(0)
    ours = augment(per_utterance=False)(x, lengths, ids, epoch=1)
    torch.manual_seed(0)
    import torchaudio
    theirs = torch.nn.Sequential(*[torchaudio.transforms.FrequencyMasking(8, iid_masks=True)] * 2,
                                 *[torchaudio.transforms.TimeMasking(20, iid_masks=True)] * 2)(x.unsqueeze(1)).squeeze(1)
    assert torch.equal(ours, theirs)
