"""The resumable sampler's start (doeks.workload.train.ResumableSampler), fast and without a job: a run stopped after
some steps and resumed from its checkpoint's `consumed` trains the rest of the epoch, each sample once, none that the
stopped run already trained, whatever world size the resumed run has. The batches are drawn through torch's own
DataLoader (batch_size, drop_last, the sampler), as the training script draws them. (The same through the real
script and checkpoints: tests/test_train_checkpoints.py, torchrun at another world size there marked slow.)"""
from __future__ import annotations

import pytest

from doeks.workload.train import ResumableSampler

SIZE, BATCH, SEED = 103, 4, 7  # a size no world or batch divides: the ragged tail is in play


def batches(world: int, rank: int, epoch: int, start: int) -> list[list[int]]:
    """What one rank's DataLoader yields for the epoch, starting after `start` samples."""
    import torch

    sampler = ResumableSampler(SIZE, rank, world, SEED, epoch, start, BATCH)
    loader = torch.utils.data.DataLoader(range(SIZE), batch_size=BATCH, sampler=sampler, drop_last=True)
    return [batch.tolist() for batch in loader]


def trained(world: int, epoch: int, start: int, steps: int | None = None) -> list[int]:
    """Every sample the `world` ranks train in their first `steps` steps (all of the epoch's when None)."""
    per_rank = [batches(world, rank, epoch, start) for rank in range(world)]
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"ranks take different numbers of steps: {counts}"  # a rank left waiting in all-reduce
    steps = counts.pop() if steps is None else steps
    return [i for rank in per_rank for batch in rank[:steps] for i in batch]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_epoch_from_the_start_trains_each_sample_once_and_drops_less_than_a_step(world):
    seen = trained(world, epoch=0, start=0)
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(SIZE))
    assert SIZE - len(seen) < world * BATCH  # only the ragged tail, shorter than one global batch, is dropped


@pytest.mark.parametrize("before,after", [(1, 1), (2, 2), (2, 3), (3, 1), (1, 2)])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_resume_mid_epoch_skips_exactly_the_trained_samples_each_once(before, after, steps):
    """Stopped after `steps` steps at world `before` (the checkpoint says consumed = steps x global batch), resumed
    at world `after`: the rest of the epoch has no sample of the first part and none twice, and together they are
    the whole epoch but for less than one global batch of the resumed run."""
    first = trained(before, epoch=1, start=0, steps=steps)
    consumed = steps * BATCH * before  # what the script records in its checkpoint
    assert len(first) == consumed
    rest = trained(after, epoch=1, start=consumed)
    assert not set(first) & set(rest), "the resumed run trains samples the stopped run already trained"
    assert len(rest) == len(set(rest)), "a sample twice in the rest of the epoch"
    assert len(first) + len(rest) > SIZE - after * BATCH, "more than the ragged tail of the epoch left out"
    # what the stopped run trained is the epoch's permutation's first `consumed`, whatever world it had
    assert set(first) == set(trained(1, epoch=1, start=0)[:consumed])


def test_the_order_depends_on_seed_and_epoch_only():
    """Each epoch is a new permutation, the same for every world size (what lets a resized job resume it)."""
    one, two = trained(1, epoch=2, start=0), trained(2, epoch=2, start=0)
    assert set(two) == set(one[:len(two)])
    assert one != trained(1, epoch=3, start=0)  # reshuffled every epoch
    sampler = ResumableSampler(SIZE, 0, 1, SEED, 0, 0, BATCH)
    first = list(sampler)
    sampler.set_epoch(0, 8)  # the same epoch again, 8 samples in: the same order without its first 8
    assert list(sampler) == first[8:8 + len(list(sampler))]


def test_each_epochs_order_is_torchs_permutation_of_seed_plus_epoch():
    """The order is a contract with the checkpoints already written: a job resumed by another doeks version must
    draw the same permutation, or it trains again samples it already had and skips others."""
    import torch

    for epoch in (0, 1, 5):
        g = torch.Generator()
        g.manual_seed(SEED + epoch)
        assert list(ResumableSampler(SIZE, 0, 1, SEED, epoch, 0, BATCH)) == torch.randperm(SIZE, generator=g).tolist()[:100]


def test_a_finished_epochs_start_leaves_nothing():
    assert trained(2, epoch=0, start=SIZE) == [] and trained(2, epoch=0, start=SIZE - 3) == []
