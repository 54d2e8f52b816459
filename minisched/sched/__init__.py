"""The scheduler layer: requests, batches, the KV page pool, the radix cache, policies, the
PrefillAdder and the scheduler loop. Pure Python, no torch: tested on the CPU with a fake runner."""
