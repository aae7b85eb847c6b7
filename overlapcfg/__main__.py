"""``python -m overlapcfg``: the main job (see ``overlapcfg.cli``)."""

from overlapcfg.cli import main

if __name__ == "__main__":
    main()
