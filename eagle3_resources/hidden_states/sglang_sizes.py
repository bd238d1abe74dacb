"""The SGLang capture's default sizes, apart from the backend (which imports torch) so that `eagle3 gpu-check` can plan
a host with them before torch is loaded."""

# Tokens in one forward (one extend). SGLang's own scheduler caps a prefill at chunked_prefill_size
# (8-16K, by GPU) so that decode keeps its KV room; capture keeps no KV between forwards, so the pool
# is only this big and a forward may be twice that. At Kimi-K2.5 size the aux output alone is
# 32768 x 3 x 7168 x 2 B = 1.4 GB per rank. It must be at least max_length (a sample is never split).
DEFAULT_MAX_FORWARD_TOKENS = 32768

# Slabs in the ring. One is enough for a serial caller (each batch is read out before the next is asked
# for); two let rank 0 copy a batch in while the parent reads the one before (extract_batch submits
# every sub-batch of a call at once). At Kimi-K2.5 size a slab of DEFAULT_MAX_FORWARD_TOKENS rows is
# 32768 x (3 + 1) x 7168 x 2 B = 1.88 GB of /dev/shm, page-locked in rank 0.
DEFAULT_HANDOFF_SLABS = 2
