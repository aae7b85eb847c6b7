"""overlapcfg's Hydra search-path plugin (see ``overlapcfg_searchpath``)."""
