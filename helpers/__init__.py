"""The helpers grpo.py's main and dit_grpo.py run on (the algorithm itself is grpo.py, which runs without them):
run.py (the run's plumbing), run_io.py (what a run writes), parallel.py (many processes), user_input.py (every reader
of what a user gives, with its rule), rewards.py (rewards beyond pixels), served_reward.py (a reward in its own
process, by URL), world.py (the tiny model's world of shapes), offline_model.py (GLM-Image built in code)."""
