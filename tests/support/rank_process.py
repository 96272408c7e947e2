"""How a test's spawned gloo rank runs its work and ends (tests/engines/test_lora_training.py,
test_fsdp_communication.py): with os._exit, as tests/checkpoint/test_checkpoint_resize.py's ranks end. FSDP2 keeps
the gloo group's threads alive, and a normal exit (a failure's too) can hang in their teardown; a failure prints its
traceback and exits 1, which the parent's join reports."""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable


def run_rank(work: Callable[..., Any], *args: Any) -> None:
    """`work(*args)`, then end the process: exit 0 when it returned, 1 when it raised."""
    code = 1
    try:
        work(*args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
