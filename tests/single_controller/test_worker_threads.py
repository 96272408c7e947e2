"""A worker host computes on the threads its pool's cpusPerDevice gives (the OMP_NUM_THREADS the group passes),
not on whatever the process started with: torch reads the variable once, when imported."""
import torch

from hybridflow.single_controller.worker_host import use_threads


def test_the_hosts_thread_count_is_applied_to_torch():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # as a process started with two (possible on one core too)
        use_threads({"OMP_NUM_THREADS": "1"})
        assert torch.get_num_threads() == 1
        use_threads({"TOKENIZERS_PARALLELISM": "false"})  # no count named: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
