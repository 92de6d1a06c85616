"""What --enable-lora takes from a replica's KV cache sized from a GPU."""

from gateway.capacity import load_catalog
from loadtest.sim.config import SimConfig, resolve
from loadtest.sim.lora_memory import lora_buffer_bytes

LLAMA_8B = load_catalog().model("llama-3.1-8b")


def test_the_adapter_buffers_of_an_8b_llama_by_layer() -> None:
    # per layer and unit of rank: qkv 3*4096 + 6144, o 4096 + 4096, gate_up 2*4096 + 28672,
    # down 14336 + 4096; embeddings and LM head 2 * (128256 + 4096); bf16
    per_layer = 3 * 4096 + 6144 + 4096 + 4096 + 2 * 4096 + 28672 + 14336 + 4096
    one_slot = 16 * (32 * per_layer + 2 * (128256 + 4096)) * 2
    assert lora_buffer_bytes(LLAMA_8B, max_loras=1, max_lora_rank=16, tp=1) == one_slot
    assert one_slot == 92_356_608
    assert lora_buffer_bytes(LLAMA_8B, max_loras=4, max_lora_rank=16, tp=1) == 4 * one_slot
    # tensor parallelism shards only the B of column layers and the A of row layers
    sharded = 16 * 32 * (6144 + 4096 + 28672 + 14336) // 2 * 2
    halved = lora_buffer_bytes(LLAMA_8B, max_loras=1, max_lora_rank=16, tp=2)
    assert halved == one_slot - sharded


def test_a_cache_sized_from_a_gpu_loses_the_buffers_and_an_explicit_one_does_not() -> None:
    base, lora = resolve(SimConfig()), resolve(SimConfig(enable_lora=True))
    assert base.num_blocks - lora.num_blocks == 45  # 92,356,608 bytes in blocks of 2 MiB
    wide = resolve(SimConfig(enable_lora=True, max_loras=4, max_lora_rank=64))
    assert base.num_blocks - wide.num_blocks == 705
    on_gpu = SimConfig(model="llama-3.1-8b", gpu="h100")
    on_gpu_lora = SimConfig(model="llama-3.1-8b", gpu="h100", enable_lora=True)
    assert resolve(on_gpu).num_blocks - resolve(on_gpu_lora).num_blocks == 45
    explicit = resolve(SimConfig(kv_tokens=4096, enable_lora=True, max_loras=4))
    assert explicit.num_blocks == 256
