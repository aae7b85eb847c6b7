"""``python -m overlapcfg``: the main job (see ``overlapcfg.demo.cli``)."""

from overlapcfg.demo.cli import main

if __name__ == "__main__":
    main()
