"""Communication as plain data: each rank's point-to-point batches and collectives, and a replay of
all ranks' sequences under NCCL's semantics that proves an order deadlock-free (no torch here).

``program`` derives what the runtime posts from the schedule (``ethpipe.schedule``) and the plan;
``replay`` executes those sequences symbolically: no buffering, one FIFO per communicator, a batch
completes as a unit, a wait blocks.
"""
