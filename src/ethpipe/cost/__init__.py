"""Cost model shared by the planner and the simulator: compute, communication and memory."""
