"""``python -m overlapcfg``: the main job (see ``overlapcfg.demo.cli``).

Under ``torchrun`` (``mode=calibrate`` / ``mode=measure``) a rank leaves through ``exit_process`` once the job is
done: on gloo, the group's threads outlive ``destroy_process_group`` and can abort a finalizing interpreter
(``overlapcfg.process_exit``). A failed job has already exited through Hydra with status 1.
"""

import os

from overlapcfg.demo.cli import main
from overlapcfg.process_exit import exit_process

if __name__ == "__main__":
    main()
    if "RANK" in os.environ:
        exit_process(0)
