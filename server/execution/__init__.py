"""One step on the device: the model runner (step inputs, forward, sampling), the executors that
run a step's forward (eager, CUDA graphs; static shapes in `static_shapes`), and the memory
profile that sizes the KV pool."""
