"""memory/pinned.py: exact-size pinned CPU memory, outside torch's caching host allocator."""
from __future__ import annotations

import gc

import pytest
import torch

from vramfit.memory import pinned


def test_plain_off_cuda_zeroed_and_shaped():
    """Without pinning the memory is plain CPU memory of the asked size, zeroed by `zeros`;
    `copy_of` copies (never the source's storage)."""
    t = pinned.zeros(1000, torch.bfloat16, pin=False)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and not t.any()
    assert pinned.empty(0, torch.float32, pin=False).numel() == 0
    src = torch.arange(12, dtype=torch.float32).view(3, 4)
    copy = pinned.copy_of(src) if not torch.cuda.is_available() else pinned.copy_of(src).cpu()
    assert torch.equal(copy, src) and copy.data_ptr() != src.data_ptr()


@pytest.mark.gpu
def test_cuda_exact_size_locked_and_released():
    """On CUDA: the memory is page-locked (asynchronous copies round-trip), torch's host
    allocator holds none of it (no power-of-two rounding, nothing cached), and it is unlocked
    when its last view goes (registering the same range again succeeds)."""
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    locked = pinned.locked_bytes()
    n = 3 * 2**20 + 17  # an odd size, which torch's allocator would round to 4 Mi values
    host = pinned.empty(n, torch.float32)
    assert host.is_pinned()
    assert pinned.locked_bytes() == locked + 4 * n
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    host.copy_(torch.arange(n, dtype=torch.float32))
    dev = host.to("cuda", non_blocking=True)
    back = pinned.zeros(n, torch.float32)
    assert pinned.locked_bytes() == locked + 8 * n
    back.copy_(dev * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, torch.arange(n, dtype=torch.float32) * 2)
    view = host[5:10]
    del host, dev, back
    gc.collect()
    assert view.is_pinned() and pinned.locked_bytes() == locked + 4 * n  # a view keeps it locked
    del view
    gc.collect()
    assert pinned.locked_bytes() == locked


def test_streamed_homes_packed_per_unit_and_fetched_whole():
    """memory/offload/weights.py: a unit's homes are views, in order, of one buffer per dtype (never
    the caller's storage), a fetch copies the buffer whole and binds views holding the weights'
    values; a weight replaced from outside is re-homed alone and its unit copied weight by weight."""
    from vramfit.memory.offload.weights import WeightStreamer

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    model.transformer_blocks[1].to(torch.bfloat16)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    originals = [p.data for p in model.parameters()]  # kept alive: their memory is not reused
    storages = {t.untyped_storage().data_ptr() for t in originals}
    streamer = WeightStreamer(model, torch.device("cpu"), blocks=("transformer_blocks",), stream=True,
                              stream_trainable=True, max_unit_bytes=2**20, offload_activations=False)
    for unit in streamer.units:
        assert set(unit.packed) == {p.dtype for p in unit.params}
        buffer = unit.packed[unit.params[0].dtype]
        assert unit.homes[0].data_ptr() == buffer.data_ptr()
        assert unit.homes[1].data_ptr() == buffer.data_ptr() + unit.homes[0].numel() * buffer.element_size()
        assert buffer.untyped_storage().data_ptr() not in storages
    unit = streamer.units[1]
    streamer.use(unit)
    assert all(p.data_ptr() == v.data_ptr() for p, v in zip(unit.params, unit.views))
    for name, p in model.transformer_blocks[1].named_parameters():
        assert torch.equal(p, values[f"transformer_blocks.1.{name}"])
    streamer.release_all()
    replaced = torch.full((8, 8), 3.0, dtype=torch.bfloat16)
    model.transformer_blocks[1].weight.data = replaced
    streamer.use(unit)
    assert unit.packed is None and torch.equal(model.transformer_blocks[1].weight, replaced)
    assert torch.equal(model.transformer_blocks[1].bias, values["transformer_blocks.1.bias"])
    streamer.release_all()


@pytest.mark.gpu
def test_cuda_a_refused_lock_falls_back_to_torchs_pinned_memory(monkeypatch, caplog):
    """Where the driver refuses to lock, the block is torch's pinned memory (with one warning), and
    CUDA work goes on."""
    real = torch.cuda.cudart()

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def cudaHostRegister(ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    monkeypatch.setattr(pinned._Locked, "warned", False)
    locked = pinned.locked_bytes()
    t = pinned.zeros(1000, torch.float32, device=torch.device("cuda"))
    assert t.is_pinned() and pinned.locked_bytes() == locked
    assert "refused to lock" in caplog.text
    assert torch.equal(t.to("cuda", non_blocking=True).cpu(), torch.zeros(1000))


def test_probe_stand_in_weights_read_as_zeros_and_take_no_host_memory():
    """fit/probe.py `untouched_zeros`: the stand-in's weights read as zeros, tied weights stay
    tied, and 256 MiB of them add almost nothing to the process's resident memory."""
    import psutil
    from accelerate import init_empty_weights

    from vramfit.fit.probe import untouched_zeros

    with init_empty_weights(include_buffers=False):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.Linear(8192, 4096),
                                    torch.nn.Linear(4096, 4096))
    model.append(torch.nn.Linear(4096, 4096, device="meta"))
    model[3].weight = model[2].weight  # tied
    model[1].bias.requires_grad_(False)
    before = psutil.Process().memory_info().rss
    untouched_zeros(model)
    grown = psutil.Process().memory_info().rss - before
    assert grown < 16 * 2**20
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model[3].weight is model[2].weight
    assert not model[1].bias.requires_grad and model[0].weight.requires_grad
    assert not model[0].weight[:2, :8].any() and not model[2].bias.any()
