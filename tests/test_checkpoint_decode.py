"""A restore decodes each saved tensor where its bytes lie (doeks/workload/checkpoint_read.py: _saved_tensor) instead of
through torch.load, which made a new storage of every tensor to copy it into the target after. Real torch.save
output and real DCP checkpoints in a folder; torch.load is the reference."""
from __future__ import annotations

import io
import warnings

import pytest

from doeks.workload import checkpoint_read, checkpoints

torch = pytest.importorskip("torch")


def _saved(tensor) -> memoryview:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return memoryview(bytearray(buffer.getvalue()))  # writable, as the restore's own buffer is


def _kinds() -> dict:
    torch.manual_seed(0)
    return {
        "dense": torch.randn(3, 4),
        "transposed": torch.randn(3, 4).t(),
        "view with an offset": torch.randn(7)[2:],
        "every other row": torch.randn(64, 64).half()[::2],
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "bfloat16": torch.randn(4, 4).to(torch.bfloat16),
        "int64": torch.arange(10, dtype=torch.int64),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "bool": torch.tensor([True, False, True]),
        "large": torch.randn(1024, 1024),
    }


@pytest.mark.parametrize("kind", list(_kinds()))
def test_a_saved_tensor_decodes_as_torch_load_reads_it_and_in_place(kind):
    tensor = _kinds()[kind]
    view = _saved(tensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing for a job's log (torch's storage classes warn when asked their dtype)
        decoded = checkpoint_read._saved_tensor(view)
    reference = torch.load(io.BytesIO(view.tobytes()), weights_only=True)
    assert decoded is not None
    assert (decoded.dtype, decoded.shape, decoded.stride(), decoded.storage_offset()) == (
        reference.dtype, reference.shape, reference.stride(), reference.storage_offset())
    assert torch.equal(decoded, reference)
    if decoded.numel():  # a view of the buffer: nothing copied
        start = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
        assert start <= decoded.data_ptr() < start + len(view)


def test_what_it_does_not_know_is_left_to_torch_load():
    """A pickle of anything but a plain tensor (a Parameter's rebuild, a dict), a cut off blob, bytes that are no
    zip: None, and the restore reads the item with torch.load as DCP does."""
    assert checkpoint_read._saved_tensor(_saved(torch.nn.Parameter(torch.randn(3)))) is None
    assert checkpoint_read._saved_tensor(_saved({"a": torch.randn(3)})) is None
    assert checkpoint_read._saved_tensor(_saved(torch.randn(100))[:-30]) is None
    assert checkpoint_read._saved_tensor(memoryview(bytearray(b"not a zip" * 10))) is None


def test_a_restore_decodes_the_tensors_without_torch_load_and_loads_them_right(tmp_path, monkeypatch):
    """A checkpoint of every kind above, a non-tensor value (DCP's bytes item) and a nested dict, saved with DCP to a
    folder and restored into fresh tensors: each equal to what was saved, no tensor through torch.load (a value
    that is not a tensor still is: DCP's own)."""
    loads = []
    real_load = torch.load

    def counting(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        loads.append(type(loaded).__name__)
        return loaded

    state = {"tensors": {k.replace(" ", "_"): v.contiguous() if k == "every other row" else v for k, v in _kinds().items()},
             "step": 7, "nested": {"w": torch.randn(5, 6)}}
    store = checkpoints.Store(str(tmp_path / "ck"), keep=1)
    store.save(state, 7, {"epoch": 1}, background=False)
    monkeypatch.setattr(torch, "load", counting)
    target = {"tensors": {k: torch.zeros_like(v) for k, v in state["tensors"].items()}, "step": 0,
              "nested": {"w": torch.zeros(5, 6)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.load(target, store.latest())
    for name, tensor in state["tensors"].items():
        assert torch.equal(target["tensors"][name], tensor), name
    assert torch.equal(target["nested"]["w"], state["nested"]["w"]) and target["step"] == 7
    assert "Tensor" not in loads and loads  # DCP's planner reads the value that is not a tensor with torch.load


def test_a_plain_tensor_is_read_straight_into_its_target(tmp_path):
    """A dense CPU tensor whose target is the same (a model's parameters, an optimizer's moments, as a job resumes)
    is read from the file into the target's memory, not into a buffer first: counted by the page faults of the load
    (a 64 MB buffer is 16384 fresh pages; the target was written before, as a model's memory is). Beside it, a
    target of other strides goes through the buffer and loads right (a resharded read, a slice of the saved tensor,
    too: tests/test_elasticjob_local.py)."""
    import resource

    torch.manual_seed(1)
    state = {"w": torch.randn(4096, 4096), "t": torch.randn(64, 32).t().contiguous(), "s": torch.randn(8, 16)}
    store = checkpoints.Store(str(tmp_path / "ck"), keep=1)
    store.save(state, 1, background=False)
    target = {"w": torch.zeros(4096, 4096), "t": torch.zeros(64, 32).t(), "s": torch.zeros(8, 16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        store.load(target, store.latest())
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert faults < 4096, f"{faults} page faults: the 64 MB tensor went through a buffer of fresh memory"


def test_a_folder_prefetch_asks_the_kernel_and_holds_nothing(tmp_path):
    """Store.prefetch on a folder: the files' readahead asked of the kernel (a shared volume's files come over the
    network), nothing kept in the process; the load after reads right. A checkpoint that is not there: False."""
    torch.manual_seed(2)
    state = {"w": torch.randn(256, 256)}
    store = checkpoints.Store(str(tmp_path / "ck"), keep=1)
    store.save(state, 3, background=False)
    assert store.prefetch("step-3") and not store._prefetched
    target = {"w": torch.zeros(256, 256)}
    store.load(target, "step-3")
    assert torch.equal(target["w"], state["w"])
    assert not store.prefetch("step-9")
