"""tgserve.kernels: Triton attention kernels, each with a torch reference twin.

dispatch        the public entry points (Triton on CUDA, the torch twins elsewhere); imports
                no Triton until a CUDA call
reference       torch twins: KV writes, paged/varlen attention, masked attention, pattern masks
kv_write        Triton: keys/values into the paged cache by slot mapping
paged_decode    Triton: one query per sequence over its paged KV, split-context (flash-decoding)
paged_prefill   Triton: varlen queries over the paged cache (chunked prefill, prefix hits) or
                over a fresh packed prompt
fused           Triton: RMSNorm (optionally after the residual add), rotary, SiLU-and-multiply
triton_common   shared Triton pieces (online-softmax tile step, softcap)
triton_support  the Triton version the CUDA kernels need, checked when the CUDA backend is chosen
sparse/         MInference-style sparse prefill: pattern configs, estimation, index, kernel
testing         paged test batches and error metrics (tests and benchmarks)
bench/          GPU benchmark, sparse-accuracy and sparse-profile scripts (not part of the package)
"""
