"""What --enable-lora takes from a simulated replica's KV cache sized from a GPU."""

from loadtest.sim.config import SimConfig, resolve


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
