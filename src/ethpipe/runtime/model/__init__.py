"""The model a stage runs: the decoder and its stages (`decoder`), tensor-parallel layers (`tensor_parallel`) and the kernel modes (`kernel_modes`: TF32, SDPA backends)."""
