"""``python -m overlapcfg`` and the ``overlapcfg`` console script: the main job (see ``overlapcfg.demo.cli``).

``main`` imports the command itself, so that Ctrl-C while Python is still importing it (Hydra, rich, the config
layer: about half a second) ends like Ctrl-C at any later moment: one line and exit status 130, not a
``KeyboardInterrupt`` traceback from the import machinery. Nothing is written before the command starts.

Under ``torchrun`` (``mode=calibrate`` / ``mode=measure``) a rank leaves through ``exit_process`` once the job is
done: on gloo, the group's threads outlive ``destroy_process_group`` and can abort a finalizing interpreter
(``overlapcfg.process_exit``). A failed job has already exited through Hydra with status 1.
"""

import os
import sys

from overlapcfg.process_exit import INTERRUPTED, exit_process


def main() -> None:
    """The console script: the command, with Ctrl-C during its start-up reported as Ctrl-C later is."""
    try:
        from overlapcfg.demo.cli import main as run_command
    except KeyboardInterrupt:
        sys.stderr.write("overlapcfg: interrupted (Ctrl-C) while starting; nothing was written\n")
        sys.exit(INTERRUPTED)
    run_command()


if __name__ == "__main__":
    main()
    if "RANK" in os.environ:
        exit_process(0)
