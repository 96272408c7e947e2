"""The driver, in three parts. What the job is: its prompts and its one reward (task), the models and worker groups
it runs on (setup). Where generations come from: the rollout modes, the rollout replicas with their failure and
scaling policies, and the weight sync (generation). How it trains: one RLHF iteration as the algorithm's program
calls it (step), the loop around the program with evaluation and resume (loop) and what follows each step
(after_step: checkpoints, step log, metrics, trackers, progress); and the checks only the machine that runs the
job can make (preflight)."""
