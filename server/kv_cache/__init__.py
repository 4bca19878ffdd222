"""The paged KV cache's shape per architecture (`spec`: one `KVCacheSpec` per layer from the HF
config) and its pool on the device (`pool`). Block ownership lives in `core.block_manager`."""
