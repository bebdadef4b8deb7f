"""The runtime: executes any Plan exactly on torch.distributed (gloo on CPU, NCCL on GPUs).

Entry points: ``run_local(plan, config)`` (spawn the world here), ``run_torchrun(plan, config)``
(one rank under torchrun), ``train(plan, config, rank, world_size)`` (one rank, any launcher),
``build_full_model`` / ``build_stage`` (the model). See docs/runtime.md.
"""
