"""The driver: one RLHF iteration as the algorithm's program calls it (step), the workers and task a job needs
(setup), the loop around the program with evaluation, checkpoints and progress (loop), and the checks only the
machine that runs the job can make (preflight)."""
