"""Streamed weights and offloaded activations: the denoiser's blocks live in CPU memory and visit
the GPU only while used; tensors saved for backward may wait in CPU memory too.

With memory.resident_blocks some of the stream blocks (units.py `stream_blocks`: the blocks, cut
into units of at most `max_unit_bytes`), the largest first and spread through the forward order,
stay on the GPU like any unstreamed weight and only the others stream: between all resident and
all streamed.

The parts, each testable alone and composed by `WeightStreamer` (weights.py), which the step
engine (train/engine.py) takes:
- units.py: what is streamed (the stream blocks but the resident ones; with `stream_trainable`, a
  full fine-tune, the trained weights too; LoRA matrices, embeddings, conv_in/out and the final
  norms stay resident), a unit's state, the counters;
- slots.py: the slot pool, device buffers (one per dtype) that units are copied into, kept;
- weights.py: the weights' homes in pinned CPU memory (a buffer per dtype a unit, copied whole),
  the copies into slots ahead of use on a side stream, eviction, the forward and backward
  boundaries, CUDA graph recording;
- grads.py: gradients of streamed weights moved home to pinned CPU memory and handed to the home
  parameters, or the weights stepped on the device in backward (the earlier micro-batches'
  gradients then summed on the device, or at home: memory.streamed_grad_sums);
- staging.py: the sums at home added by a worker thread behind the gradients' copies there;
- activations.py: other saved-for-backward tensors offloaded into kept pinned buffers.
Pinned memory is of exactly the size asked for (memory/pinned.py).

Costs: per step the streamed weights cross PCIe about twice (forward, and backward's recompute
under checkpointing or its re-fetch of saved weights without), and for a full fine-tune their
gradients once back (stepped on the device: their new values once back instead); otherwise the
optimizer step of the streamed weights runs on the CPU after backward, not overlapped with the
GPU; host memory holds the weights, their gradients and optimizer state, pinned. On the device:
the slots (kept between steps: as many units as are held at once, two or three where a
checkpointed block is one unit), the resident weights, and the streamed gradients only until
their copy to the host is done. Stepping on the device costs the optimizer state and up to a unit
of waiting gradients there (with accumulation and sums on the device, their sums too, kept), and no weight crosses PCIe more often than before (the ones fetched
again alone once more); the CPU step's seconds become milliseconds of GPU work. Under mixed_bf16
without checkpointing the bf16 casts autocast makes of the weights are saved as they are (on the
device); autocast's cache of them is cleared at each change of unit. On CPU-only runs every step
still copies into separate compute tensors, so tests see the mechanism work.
"""
from vramfit.memory.offload.units import StreamStats, block_modules, resident_blocks, split_units
from vramfit.memory.offload.weights import WeightStreamer, stream_weights

__all__ = ["StreamStats", "WeightStreamer", "block_modules", "resident_blocks", "split_units",
           "stream_weights"]
